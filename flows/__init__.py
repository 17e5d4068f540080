"""Prefect orchestration of the DVC pipeline: `flows.pipeline.mars_pipeline`, served by `python -m flows.serve`."""
