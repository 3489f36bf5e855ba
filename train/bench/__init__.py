"""Benchmarks (``make bench``): figures written as JSON and as a markdown table."""
