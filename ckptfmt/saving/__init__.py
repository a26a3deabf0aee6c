"""The save path: save and async_save, the options they share, staging into reused host buffers,
splitting tensors into chunks, hashing and writing them, and committing the manifest (spec section
11).
"""
