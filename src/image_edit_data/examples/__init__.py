"""examples"""
