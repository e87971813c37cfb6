"""What every command shares: the options, the config loader and the one-line errors.

Errors are one line, ``error: …``, naming the file:line, key or value and what to do, and exit with 2 for
bad input (config, prompt files, an unknown stage, permission or decode errors), 1 for any other failure.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from drafter.core.config import ReleaseConfig, load_config
from drafter.core.errors import BadInputError, ConfigError, DrafterError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Release pipeline for speculative-decoding drafters.")
console = Console()

ConfigOpt = typer.Option(Path("configs/demo.yaml"), "--config", "-c", help="Release config (YAML).")
ProfileOpt = typer.Option(None, "--profile", "-p", help="Named profile from the config's `profiles:` block (e.g. quick).")
SetOpt = typer.Option(None, "--set", "-s", help="Override a field: section.field=value (repeatable).")
StoreOpt = typer.Option(None, "--store", help="Store root (local path or fsspec URL); overrides store.root.")


def one_line(message: object) -> str:
    """A message as one line: a multi-line one (several invalid fields) joined with '; '."""
    lines = [ln.strip() for ln in str(message).splitlines() if ln.strip()]
    out = lines[0] if lines else ""
    for ln in lines[1:]:
        out += (" " if out.endswith(":") else "; ") + ln
    return out


def fail(message: object, code: int) -> None:
    """Print `error: <one line>` to stderr and exit with ``code`` (no traceback)."""
    typer.echo(f"error: {one_line(message)}", err=True)
    raise typer.Exit(code)


_BAD_INPUT = (ConfigError, BadInputError, PermissionError, UnicodeError)


def exit_code(e: BaseException) -> int:
    """2 for bad input (config, prompt files, permission or decode errors), 1 for other failures.

    The original error decides: a wrapper that is neither one of the pipeline's errors nor bad input
    (the release flow's :class:`drafter_prefect.release.ReleaseFailed`, a RuntimeError around the stage's error) is
    looked through along its explicit causes (``raise … from e``), as
    :func:`drafter.core.errors.is_permanent` walks them; the first pipeline error or bad input found decides.
    """
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, _BAD_INPUT):
            return 2
        if isinstance(cur, DrafterError):
            return 1
        cur = cur.__cause__
    return 1


def cli_errors(fn):
    """Every command: the pipeline's errors, an unknown stage, OS, permission and decode errors
    become one `error: …` line and a non-zero exit instead of a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DrafterError as e:
            fail(e, exit_code(e))
        except KeyError as e:  # drafter.stages / pipeline.plan: an unknown stage name
            msg = str(e.args[0]) if e.args else ""
            if not msg.startswith("unknown stage"):
                raise
            fail(msg, 2)
        except UnicodeDecodeError as e:
            fail(f"a file is not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8", 2)
        except OSError as e:
            what = f"{e.filename}: " if e.filename else ""
            fail(f"{what}{e.strerror or e}; check the path and its permissions", exit_code(e))

    return wrapper


def load(config: Path, profile: Optional[str], sets: Optional[list[str]], store: Optional[str], *,
          check: bool = False, stages: Optional[list[str]] = None, **preflight_kw) -> ReleaseConfig:
    """Load the config; with ``check``, run the preflight checks for ``stages`` (every error: one line)."""
    return load_checked(config, profile, sets, store, check=check, stages=stages, **preflight_kw)[0]


def load_checked(config: Path, profile: Optional[str], sets: Optional[list[str]], store: Optional[str], *,
                 check: bool = True, stages: Optional[list[str]] = None, **preflight_kw):
    """(config, the preflight report or None): :func:`load`, keeping the report (the release flow accepts it)."""
    overrides = list(sets or [])
    if store:
        overrides.append(f"store.root={store}")
    try:
        cfg = load_config(config, profile=profile, overrides=overrides)
    except DrafterError as e:
        msg = one_line(e)
        if msg.startswith("invalid config"):
            msg += f"; fix the field in {config} or with --set section.field=value"
        fail(msg, 2)
    if check:
        from drafter.data.preflight import preflight

        return cfg, preflight(cfg, stages or None, **preflight_kw)
    return cfg, None
