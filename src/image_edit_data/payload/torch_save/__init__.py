"""torch_save"""
