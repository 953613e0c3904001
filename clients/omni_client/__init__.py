"""omni_client"""
