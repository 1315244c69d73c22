"""lightning"""
