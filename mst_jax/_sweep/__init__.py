"""The sweep over row chunks: the loop orders and their gradient strategies,
the custom VJPs that run them, and the loop orders over a device mesh.
"""
