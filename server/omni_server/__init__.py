"""omni-server: a model-repository server for multi-stage speech and omni pipelines."""

__version__ = "0.1.0"
