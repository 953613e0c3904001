"""omni_bench"""
