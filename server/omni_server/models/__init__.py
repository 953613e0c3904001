"""Model code for families the engine does not run yet, in plain torch (transformers is only
the tests' oracle): each subpackage reads its published checkpoint folder by the published
tensor names. A later engine family wraps these modules (this room imports nothing of the
server's)."""
