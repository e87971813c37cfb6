"""EXL3 form of a drafter, made with exllamav3's own converter (needs CUDA).

exllamav3 (https://github.com/turboderp-org/exllamav3) compiles its CUDA extension when imported,
so the converter runs as a subprocess of a CUDA Python environment (``quantize_exl3.python``, this
interpreter by default) and this module never imports it; a small probe subprocess says first
whether that environment has CUDA, the toolkit and exllamav3.

**How the drafter layers are converted.** exllamav3 (read at version 1.6.5) converts whole models of
the architectures it knows. For ``Glm4MoeForCausalLM`` and ``DeepseekV3ForCausalLM`` it has no MTP
component (it has one only for MLA/DSA relatives such as GLM-4.7-Flash), so the MTP layer is
presented as a **one-layer model of the target's own architecture**
(:func:`plan_presentation`, :func:`write_input_dir`):

=========================================  ======================================
release name (MTP layer ``L``)             converter input (1-layer model)
=========================================  ======================================
``model.layers.L.<decoder block>``         ``model.layers.0.<decoder block>``
``model.layers.L.shared_head.norm.weight`` ``model.norm.weight``
``model.layers.L.shared_head.head.weight`` ``lm_head.weight`` (``head_bits``)
the shared embedding                       ``model.embed_tokens.weight`` (kept FP16)
``model.layers.L.{enorm,hnorm,eh_proj}``   **not converted** (no slot in the 1-layer model)
=========================================  ======================================

The decoder block's projections (attention, routed and shared experts) become EXL3 tensors
(``<name>.trellis`` int16 ``[in/16, out/16, 16·bits]``, ``.suh``/``.svh`` FP16 sign/scale vectors
of the padded input/output, and a codebook marker ``.mul1``/``.mcg``, int32 scalar); norms, the
router and (MLA) ``kv_b_proj`` stay unquantized as exllamav3 keeps them. ``enorm``, ``hnorm`` and
``eh_proj`` are written unquantized (BF16) next to the EXL3 model, and the per-tensor report says
so; a ``bits`` override naming them is reported as not applied. Calibration runs exllamav3's
built-in corpus through the 1-layer model, so the block's Hessians come from embedding inputs, not
from ``eh_proj`` outputs: the per-tensor relative error (weight space, measured by dequantizing with
exllamav3's own ``LinearEXL3.get_weight_tensor``) is exact, the calibration is an approximation.

Per-tensor bits: ``bits`` (the converter's budgeted average) and ``head_bits``; ``overrides``
(fnmatch pattern or substring of the release name → bits) become an exllamav3 ``--recipe`` (base
rate ``bits`` for every budgeted tensor, the override's rate for the matched ones).

Example::

    pres = plan_presentation(config, release_shapes)
    cmd = converter_command(python, in_dir, out_dir, work_dir, bits=5, head_bits=6)
    validate_output(out_dir, pres, expected_bits(pres, recipe), codebook="mul1", head_bits=6)
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from drafter.core import procs
from drafter.core.errors import StageError
from drafter.quant.exl3_plan import (HALF_RATES, INPUT_DTYPE, KEPT_BY_EXLLAMA, NOT_CONVERTED_REASON,  # noqa: F401
                                     SUPPORTED_ARCHS, TOKENIZER_FILES, BitsPlan, Presentation, is_exl3_rate,
                                     plan_bits, plan_presentation, rate_number, write_input_dir)

CONVERTER_MODULE = "exllamav3.conversion.convert_model"
CODEBOOK_MARKER = {"mul1": "mul1", "mcg": "mcg", "3inst": None}

_LOG_LINEAR_RE = re.compile(r"^ -- Quantized: (?P<key>\S+)\s+bpw:\s*(?P<bpw>[\d.]+)\s+(?P<label>proxy_err|rmse)\s*:\s*"
                            r"(?P<err>\S+)")


# ------------------------------------------------------------------------------------------ probe


PROBE_CODE = r"""
import importlib.metadata, importlib.util, json, sys
r = {"python": sys.executable}
try:
    import torch
    r["torch"] = torch.__version__
    r["torch_cuda"] = torch.version.cuda
    r["cuda"] = bool(torch.cuda.is_available())
    r["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if r["cuda"] else []
    from torch.utils import cpp_extension
    r["cuda_home"] = cpp_extension.CUDA_HOME
except Exception as e:
    r["torch_error"] = f"{type(e).__name__}: {e}"
r["exllamav3"] = importlib.metadata.version("exllamav3") if importlib.util.find_spec("exllamav3") else None
print(json.dumps(r))
"""


@dataclass(frozen=True)
class Probe:
    """What a Python environment offers for EXL3 (found without importing exllamav3)."""

    python: str
    info: dict
    missing: str | None  # None = ready; else "needs CUDA: …" / "needs exllamav3: …"

    @property
    def ok(self) -> bool:
        return self.missing is None


def _probe_this_interpreter() -> dict | None:
    """PROBE_CODE's answer for this interpreter, found here when it sees no CUDA device (every stage plan asks: a probe
    process costs a torch import, ~3 s of CPU); None when it sees one (naming the devices would initialize CUDA in
    this process, which then holds GPU memory for its lifetime: the probe process finds them)."""
    import torch

    if torch.cuda.is_available():
        return None
    return {"python": sys.executable, "torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda": False,
            "devices": [], "cuda_home": None,  # a toolkit matters only with a device (probe_finding)
            "exllamav3": importlib.metadata.version("exllamav3") if importlib.util.find_spec("exllamav3") else None}


def probe_python(python: str | None = None, timeout_s: float = 120.0) -> Probe:
    """Run a tiny probe in ``python`` (default: this interpreter): torch, CUDA devices, the CUDA toolkit
    (exllamav3 compiles its extension with it) and whether exllamav3 is installed. This interpreter without a CUDA
    device answers in this process."""
    python = python or sys.executable
    if python == sys.executable and (info := _probe_this_interpreter()) is not None:
        return Probe(python, info, probe_finding(info))
    try:
        proc = subprocess.run([python, "-c", PROBE_CODE], capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError:
        return Probe(python, {}, f"needs CUDA: the configured python {python} does not exist")
    except subprocess.TimeoutExpired:
        return Probe(python, {}, f"needs CUDA: the probe of {python} did not answer within {timeout_s:.0f} s")
    try:
        info = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        tail = (proc.stderr or proc.stdout).strip()[-400:]
        return Probe(python, {}, f"needs CUDA: the probe of {python} failed (exit {proc.returncode}): {tail}")
    return Probe(python, info, probe_finding(info))


def probe_finding(info: dict) -> str | None:
    """The reason an environment cannot convert to EXL3, from a probe result; None when it can."""
    py = info.get("python", "?")
    if "torch_error" in info:
        return f"needs CUDA: {py} cannot import torch ({info['torch_error']})"
    if not info.get("cuda"):
        build = f"a CUDA {info['torch_cuda']} build" if info.get("torch_cuda") else "a CPU-only build"
        return (f"needs CUDA: torch {info.get('torch')} in {py} ({build}) sees no CUDA device "
                "(exllamav3 compiles and runs CUDA kernels; set quantize_exl3.python to a CUDA environment)")
    if not info.get("cuda_home"):
        return (f"needs CUDA: {py} has CUDA devices {info.get('devices')} but no CUDA toolkit (nvcc, CUDA_HOME) "
                "to compile exllamav3's extension")
    if not info.get("exllamav3"):
        return (f"needs exllamav3: {py} has CUDA ({', '.join(info.get('devices') or [])}) but exllamav3 is not "
                "installed (pip install exllamav3, or set quantize_exl3.python)")
    return None



# ---------------------------------------------------------------------------------- converter


def converter_command(python: str, in_dir: Path, out_dir: Path, work_dir: Path, *, bits: float, head_bits: float,
                      recipe: Path | None = None, codebook: str = "mul1", cal_rows: int = 250, cal_cols: int = 2048,
                      resume: bool = False, extra_args: list[str] | None = None) -> list[str]:
    """exllamav3's converter command line (``python -m exllamav3.conversion.convert_model``).

    ``resume`` continues an interrupted job from ``work_dir`` (exllamav3's ``--resume``; the job's own
    ``args.json`` there holds the settings)."""
    cmd = [python, "-m", CONVERTER_MODULE, "-w", str(work_dir)]
    if resume:
        return cmd + ["-r"] + list(extra_args or [])
    cmd += ["-i", str(in_dir), "-o", str(out_dir), "-b", f"{rate_number(bits)}", "-hb", f"{rate_number(head_bits)}",
            "-cb", codebook, "-cr", str(cal_rows), "-cc", str(cal_cols)]
    if recipe is not None:
        cmd += ["-rcp", str(recipe)]
    return cmd + list(extra_args or [])


def parse_converter_log(lines) -> dict[str, dict]:
    """Per-linear lines of the converter log → {key: {"bits", "proxy_err"|"rmse"}} (the converter's own
    calibrated estimate; None where it printed (zero)/(big)/(OoM))."""
    out = {}
    for line in lines:
        m = _LOG_LINEAR_RE.match(line.rstrip("\n"))
        if m:
            try:
                err = float(m.group("err"))
            except ValueError:
                err = None
            out[m.group("key")] = {"bits": float(m.group("bpw")), m.group("label"): err}
    return out


def run_converter(cmd: list[str], log_path: Path, *, total: int, timeout_s: float,
                  env: dict[str, str] | None = None, on_line: Callable[[str], None] | None = None) -> list[str]:
    """Run the converter, teeing its output to ``log_path`` with a progress bar over quantized linears.

    Raises :class:`StageError` with the log's tail on a non-zero exit, an ``!! Error`` line (the
    converter reports bad arguments that way and exits 0) or a timeout."""
    from drafter.core.progress import progress

    lines: list[str] = []
    t0 = time.monotonic()
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "a") as log, progress("exl3 convert", total=total, unit="tensors") as bar:
        log.write("$ " + " ".join(cmd) + "\n")
        proc = procs.spawn(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env, bufsize=1)
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                log.write(line)
                lines.append(line)
                if _LOG_LINEAR_RE.match(line):
                    bar.advance(1)
                if on_line:
                    on_line(line)
                if time.monotonic() - t0 > timeout_s:
                    procs.stop(proc)
                    raise StageError(f"exllamav3's converter ran past quantize_exl3.timeout_s={timeout_s:.0f} s; "
                                     f"log: {log_path}")
            rc = proc.wait()
        finally:
            procs.stop(proc)  # the converter and anything it started
    tail = "".join(lines[-30:])
    errors = [ln.strip() for ln in lines if ln.startswith(" !! Error") or ln.startswith(" ## ")]
    if rc != 0 or errors:
        raise StageError(f"exllamav3's converter failed (exit {rc}){': ' + errors[0] if errors else ''}; "
                         f"log {log_path}, last lines:\n{tail}")
    return lines


# ---------------------------------------------------------------------------------- validation


def _tensor_index(model_dir: Path) -> dict[str, Path]:
    from safetensors import safe_open

    idx = model_dir / "model.safetensors.index.json"
    if idx.is_file():
        try:
            wm = json.loads(idx.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise StageError(f"{idx}: not a safetensors index ({e})") from e
        files = {f: model_dir / f for f in set(wm.values())}
        for f, p in files.items():
            if not p.is_file():
                raise StageError(f"{idx} names shard {f}, which does not exist")
        return {k: files[f] for k, f in wm.items()}
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise StageError(f"{model_dir}: no model.safetensors (nor model.safetensors.index.json)")
    with safe_open(str(single), framework="pt") as f:
        return {k: single for k in f.keys()}


def _read(index: dict[str, Path], name: str):
    from safetensors import safe_open

    with safe_open(str(index[name]), framework="pt") as f:
        return f.get_tensor(name)


def _pad128(n: int) -> int:
    return -(-n // 128) * 128


def validate_output(model_dir: Path, pres: Presentation, plan: BitsPlan, *, codebook: str = "mul1") -> dict[str, Any]:
    """Check an exllamav3 output directory against the presentation and the bits plan.

    Checks ``config.json`` ``quantization_config`` (``quant_method: exl3``, ``bits`` 1-8, ``head_bits``,
    ``codebook``), ``quantization_config.json`` (``tensor_storage`` per linear), and per converted
    linear: ``.trellis`` (int16 ``[pad128(in)/16, pad128(out)/16, 16·bits]``), ``.suh``/``.svh`` (FP16,
    padded in/out), the codebook marker, no leftover ``.weight``, overridden bits exact; the unquantized
    tensors present with their shapes; no NaN/inf anywhere. Raises :class:`StageError` naming the
    file and tensor. Returns {"bits": achieved average, "head_bits", "per_tensor_bits": {key: bits},
    "size_bytes"}.
    """
    model_dir = Path(model_dir)
    qbits, storage, qc_path = _check_quant_config(model_dir, plan, codebook)
    index = _tensor_index(model_dir)
    per_tensor_bits: dict[str, float] = {}
    linears = dict(pres.quantized)
    if plan.head_bits != 16:
        linears[pres.head_key] = pres.names[pres.head_key + ".weight"]
    for key, rel in linears.items():
        want_bits = plan.head_bits if key == pres.head_key else plan.per_tensor.get(key)
        k = _check_exl3_linear(model_dir, index, key, rel, pres.shapes[key + ".weight"], want_bits, codebook)
        if k is None:  # override 16: stored unquantized
            continue
        st = storage.get(key)
        if st is None or st.get("quant_format") != "exl3" or float(st.get("bits_per_weight", -1)) != k:
            raise StageError(f"{qc_path}: tensor_storage[{key!r}] is {st!r}, expected quant_format exl3 at {k:g} bits")
        per_tensor_bits[key] = float(k)
    _check_unquantized(model_dir, index, pres, per_tensor_bits)
    size = sum(p.stat().st_size for p in set(index.values()))
    return {"bits": float(qbits), "head_bits": plan.head_bits, "per_tensor_bits": per_tensor_bits, "size_bytes": size}


def _check_quant_config(model_dir: Path, plan: BitsPlan, codebook: str) -> tuple[float, dict, Path]:
    """``config.json``'s ``quantization_config`` and the one-layer shape, then ``quantization_config.json``;
    returns (the average bits, its ``tensor_storage``, its path)."""
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise StageError(f"{model_dir}: config.json is missing (not an exllamav3 output directory)")
    cfg = json.loads(cfg_path.read_text())
    q = cfg.get("quantization_config")
    if not isinstance(q, dict) or q.get("quant_method") != "exl3":
        raise StageError(f"{cfg_path}: quantization_config.quant_method is {None if not isinstance(q, dict) else q.get('quant_method')!r}, expected 'exl3'")
    qbits = q.get("bits")
    if not isinstance(qbits, (int, float)) or not 1 <= qbits <= 8:
        raise StageError(f"{cfg_path}: quantization_config.bits={qbits!r}, expected a number in 1..8")
    if float(q.get("head_bits", -1)) != plan.head_bits:
        raise StageError(f"{cfg_path}: quantization_config.head_bits={q.get('head_bits')!r}, expected {rate_number(plan.head_bits)}")
    if q.get("codebook", codebook) != codebook:
        raise StageError(f"{cfg_path}: quantization_config.codebook={q.get('codebook')!r}, expected {codebook!r}")
    if cfg.get("num_hidden_layers") != 1:
        raise StageError(f"{cfg_path}: num_hidden_layers={cfg.get('num_hidden_layers')}, expected the one-layer drafter model")
    qc_path = model_dir / "quantization_config.json"
    if not qc_path.is_file():
        raise StageError(f"{model_dir}: quantization_config.json is missing (exllamav3 writes it last; incomplete output?)")
    return qbits, json.loads(qc_path.read_text()).get("tensor_storage", {}), qc_path


def _check_exl3_linear(model_dir: Path, index: dict[str, Path], key: str, rel: str, shape: tuple[int, ...],
                       want_bits: float | None, codebook: str) -> float | None:
    """One converted linear ``key`` (drafter tensor ``rel``, weight ``shape`` [out, in]): its EXL3 tensors
    and codebook marker, or its ``.weight`` when the plan keeps it at 16 bits (then None). Returns its bits."""
    import torch

    out_f, in_f = shape
    where = lambda s: f"{index.get(key + '.' + s, model_dir)}: tensor {key}.{s} (drafter {rel})"  # noqa: E731
    if want_bits == 16:
        if key + ".weight" not in index:
            raise StageError(f"{model_dir}: tensor {key}.weight (drafter {rel}, override 16 = unquantized) is missing")
        return None
    for s in ("trellis", "suh", "svh"):
        if key + "." + s not in index:
            raise StageError(f"{model_dir}: tensor {key}.{s} is missing (drafter {rel} should be EXL3)")
    if key + ".weight" in index:
        raise StageError(f"{index[key + '.weight']}: tensor {key}.weight left unquantized next to its EXL3 tensors")
    tr = _read(index, key + ".trellis")
    if tr.dtype != torch.int16 or tr.dim() != 3 or tuple(tr.shape[:2]) != (_pad128(in_f) // 16, _pad128(out_f) // 16):
        raise StageError(f"{where('trellis')} is {tr.dtype} {tuple(tr.shape)}, expected int16 "
                         f"[{_pad128(in_f) // 16}, {_pad128(out_f) // 16}, 16·bits] for weight {(out_f, in_f)}")
    k = tr.shape[2] / 16
    if not is_exl3_rate(k) or k > 8:
        raise StageError(f"{where('trellis')}: last dim {tr.shape[2]} is not 16·bits for a rate exllamav3 writes")
    if want_bits is not None and k != want_bits:
        raise StageError(f"{where('trellis')}: {k:g} bits, but the plan gives {rate_number(want_bits)}")
    for s, n in (("suh", _pad128(in_f)), ("svh", _pad128(out_f))):
        t = _read(index, key + "." + s)
        if t.dtype != torch.float16 or tuple(t.shape) != (n,):
            raise StageError(f"{where(s)} is {t.dtype} {tuple(t.shape)}, expected float16 [{n}]")
        if not torch.isfinite(t).all():
            raise StageError(f"{where(s)} has {int((~torch.isfinite(t)).sum())} NaN/inf value(s)")
    marker = CODEBOOK_MARKER[codebook]
    if marker is not None:
        if key + "." + marker not in index:
            raise StageError(f"{model_dir}: tensor {key}.{marker} (the {codebook} codebook marker) is missing")
        m = _read(index, key + "." + marker)
        if m.dtype != torch.int32 or m.numel() != 1:
            raise StageError(f"{where(marker)} is {m.dtype} {tuple(m.shape)}, expected an int32 scalar")
    return k


def _check_unquantized(model_dir: Path, index: dict[str, Path], pres: Presentation,
                       per_tensor_bits: dict[str, float]) -> None:
    """Every presented tensor not converted to EXL3: present, with its shape, finite."""
    import torch

    for name, shape in pres.shapes.items():
        key = name[: -len(".weight")] if name.endswith(".weight") else name
        if key in per_tensor_bits:
            continue
        if name not in index:
            raise StageError(f"{model_dir}: tensor {name} (drafter {pres.names[name]}) is missing")
        t = _read(index, name)
        if tuple(t.shape) != tuple(shape):
            raise StageError(f"{index[name]}: tensor {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        if t.is_floating_point() and not torch.isfinite(t.float()).all():
            raise StageError(f"{index[name]}: tensor {name} has {int((~torch.isfinite(t.float())).sum())} NaN/inf value(s)")


# ---------------------------------------------------------------------------- dequantization


def relative_error(w_ref, w_q) -> float:
    """‖W_q − W‖_F / ‖W‖_F (float64)."""
    a, b = w_ref.double(), w_q.double()
    den = float(a.norm())
    return float((b - a).norm()) / den if den > 0 else float("nan") if float(b.norm()) > 0 else 0.0


def dequant_errors(in_dir: Path, model_dir: Path, keys: list[str], device: str = "cuda") -> dict[str, dict]:
    """Per EXL3 linear: relative error of exllamav3's own dequantization (``LinearEXL3.get_weight_tensor``)
    against the converter's input weight. Runs where exllamav3 imports (CUDA): called through
    :func:`measure_errors` in the configured Python."""
    import torch
    from exllamav3.modules.quant.exl3 import LinearEXL3  # compiles/loads the CUDA extension

    src, out = _tensor_index(Path(in_dir)), _tensor_index(Path(model_dir))
    res = {}
    with torch.inference_mode():
        for key in keys:
            w = _read(src, key + ".weight").float()
            out_f, in_f = w.shape
            get = {s: _read(out, f"{key}.{s}") for s in ("suh", "svh", "trellis", "mcg", "mul1") if f"{key}.{s}" in out}
            tr = get["trellis"].to(device)
            lin = LinearEXL3(None, tr.shape[0] * 16, tr.shape[1] * 16, suh=get["suh"].to(device),
                             svh=get["svh"].to(device), trellis=tr, mcg=get.get("mcg"), mul1=get.get("mul1"), key=key)
            wq = lin.get_weight_tensor().float().cpu()[:in_f, :out_f].T
            res[key] = {"rel_error": relative_error(w, wq), "finite": bool(torch.isfinite(wq).all()),
                        "bits": tr.shape[2] / 16}
            del lin, tr
    return res


def measure_errors(python: str, in_dir: Path, model_dir: Path, keys: list[str], out_json: Path,
                   log_path: Path, timeout_s: float) -> tuple[dict[str, dict] | None, str | None]:
    """Run :func:`dequant_errors` in ``python`` (a subprocess: exllamav3 loads CUDA code at import).
    Returns (errors, None) or (None, why not)."""
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [python, "-m", "drafter.quant.exl3", "errors", str(in_dir), str(model_dir), str(out_json), *keys]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None, f"dequantization did not finish within {timeout_s:.0f} s"
    with open(log_path, "a") as log:
        log.write("$ " + " ".join(cmd[:6]) + " …\n" + proc.stdout + proc.stderr)
    if proc.returncode != 0 or not out_json.is_file():
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"dequantization with exllamav3 failed (exit {proc.returncode}): {last} (log: {log_path})"
    return json.loads(out_json.read_text()), None


def error_report(pres: Presentation, plan: BitsPlan, checked: dict, dequant: dict | None, why_not: str | None,
                 log_errors: dict[str, dict], meta: dict) -> dict:
    """The ``exl3-error.json`` document: per release tensor, its EXL3 name, bits, relative error (or why
    none), the converter's own proxy error; the tensors not converted and why; what each override did."""
    tensors = {}
    linears = dict(pres.quantized)
    linears[pres.head_key] = pres.names[pres.head_key + ".weight"]
    for key, rel in sorted(linears.items(), key=lambda kv: kv[1]):
        row: dict[str, Any] = {"exl3_name": key, "shape": list(pres.shapes[key + ".weight"]),
                               "bits": checked["per_tensor_bits"].get(key, 16.0)}
        if key not in checked["per_tensor_bits"]:
            row.update(rel_error=0.0, note="stored unquantized (16 bits)")
        elif dequant is not None and key in dequant:
            row["rel_error"] = dequant[key]["rel_error"]
        else:
            row.update(rel_error=None, why_no_error=why_not or "not dequantized")
        if key in log_errors:
            row["converter_proxy_err"] = log_errors[key].get("proxy_err", log_errors[key].get("rmse"))
        tensors[rel] = row
    errs = [r["rel_error"] for r in tensors.values() if isinstance(r.get("rel_error"), float) and r["bits"] != 16]
    return {
        **meta,
        "method": "relative Frobenius error ||W_q - W||/||W|| of exllamav3's dequantized weight vs the converter input "
                  "(BF16 copy of the fine-tuned drafter)" if dequant is not None else None,
        "dequantization": "exllamav3 LinearEXL3.get_weight_tensor" if dequant is not None else why_not,
        "bits": checked["bits"], "head_bits": checked["head_bits"],
        "mean_rel_error": sum(errs) / len(errs) if errs else None, "max_rel_error": max(errs) if errs else None,
        "tensors": tensors,
        "not_converted": pres.not_converted,
        "overrides": plan.overrides,
    }


def _main(argv: list[str]) -> int:
    if len(argv) >= 4 and argv[0] == "errors":
        in_dir, model_dir, out_json, *keys = argv[1:]
        res = dequant_errors(Path(in_dir), Path(model_dir), keys)
        Path(out_json).write_text(json.dumps(res, indent=2))
        for k, v in res.items():
            print(f"{k}: rel_error={v['rel_error']:.5f} bits={v['bits']:g}")
        return 0
    print("usage: python -m drafter.quant.exl3 errors IN_DIR EXL3_DIR OUT_JSON KEY...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
