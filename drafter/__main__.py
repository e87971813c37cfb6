"""``python -m drafter …``: the `drafter` command line (``python -m drafter stage NAME -c C --store S`` runs one
stage without Prefect: the containers' entrypoint)."""
from drafter.cli import main

if __name__ == "__main__":
    main()
