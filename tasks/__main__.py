"""Container entrypoint: ``python -m tasks <stage> --config C [--store S] [--set a.b=v ...]``."""
from flows.cli import stage_main

if __name__ == "__main__":
    stage_main()
