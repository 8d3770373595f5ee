"""Write and read Hugging Face model directories from `(hf_name, tensor)` pairs.

Invariants: a directory is written under a temporary name and renamed into place, so readers never see a
half-written one; with `tie_word_embeddings` in the config, `lm_head.weight` is not stored (transformers ties it
on load); config, generation config and tokenizer files are copied from a source HF directory unchanged.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

HF_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",  # a vision-language model's image processor (agentrl.vision)
    "processor_config.json",
)
WEIGHTS_FILE = "model.safetensors"


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it replaces `path` (the old one is removed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        yield tmp
        _fsync_dir(tmp)
        old = None
        if path.exists():
            old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
            os.rename(path, old)
        os.rename(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    for f in path.iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())


def copy_hf_files(src_dir: str | Path, dst_dir: str | Path) -> list[str]:
    """Copy config and tokenizer files (no weights) that exist in `src_dir`; returns the names copied."""
    src, dst = Path(src_dir), Path(dst_dir)
    copied = []
    for name in HF_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    if "config.json" not in copied:
        from agentrl.errors import LearnerError

        raise LearnerError(f"{src}: no config.json (not a Hugging Face model directory)")
    return copied


def tied_embeddings(config_dir: str | Path) -> bool:
    config = json.loads((Path(config_dir) / "config.json").read_text())
    return bool(config.get("tie_word_embeddings", False))


def write_weights(path: str | Path, named_tensors: Iterable[tuple[str, torch.Tensor]], tied: bool) -> int:
    """Write `(hf_name, tensor)` pairs to one safetensors file; returns the number of tensors written."""
    from safetensors.torch import save_file

    tensors = {}
    seen: set[int] = set()
    for name, tensor in named_tensors:
        if tied and name == "lm_head.weight":
            continue
        t = tensor.detach().to("cpu").contiguous()
        # safetensors refuses tensors that share memory: a slice of a larger storage (a fused weight's part)
        # or a storage already written is copied out; a tensor owning its storage (a checkpoint's host copy)
        # is written as it is, without a second copy
        storage = t.untyped_storage()
        shared = storage.data_ptr() in seen or storage.nbytes() != t.numel() * t.element_size()
        seen.add(storage.data_ptr())
        tensors[name] = t.clone() if shared else t
    save_file(tensors, str(path), metadata={"format": "pt"})
    if (Path(path).parent / "config.json").is_file():
        stamp_dtype(Path(path).parent)
    return len(tensors)


# safetensors' header names -> the names config.json uses (transformers' `dtype`, formerly `torch_dtype`)
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


def stamp_dtype(model_dir: str | Path) -> str | None:
    """Make config.json's `dtype` say what `model.safetensors` stores: the floating dtype holding most of its
    values (a bf16 learner's weights exported beside the base model's `float32` would load upcast, doubling
    memory, and mislead SGLang's `--dtype auto`). Returns that dtype (None when the file holds no floats)."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    counts: dict[str, int] = {}
    with safe_open(str(model_dir / WEIGHTS_FILE), framework="pt") as f:
        names = f.keys()  # safe_open is not iterable
        for name in names:
            view = f.get_slice(name)
            dtype = _SAFETENSORS_DTYPES.get(view.get_dtype())
            if dtype is not None:
                numel = 1
                for dim in view.get_shape():
                    numel *= dim
                counts[dtype] = counts.get(dtype, 0) + numel
    if not counts:
        return None
    stored = max(counts, key=counts.__getitem__)
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    if config.get("dtype", config.get("torch_dtype")) != stored:
        config["dtype"] = stored
        config.pop("torch_dtype", None)
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return stored


def save_hf_dir(
    out_dir: str | Path, named_tensors: Iterable[tuple[str, torch.Tensor]], config_dir: str | Path
) -> Path:
    """Atomically write a loadable HF directory: weights from the pairs, config + tokenizer from `config_dir`."""
    out = Path(out_dir)
    with atomic_dir(out) as tmp:
        copy_hf_files(config_dir, tmp)
        write_weights(tmp / WEIGHTS_FILE, named_tensors, tied_embeddings(tmp))
    return out


_RENAMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {state_dict name: file name}


def _renames(model: torch.nn.Module) -> dict[str, str]:
    """Each `state_dict` name that its checkpoint files hold as one tensor, with that file name (itself for most
    models; a VLM's `model.visual.*` -> `visual.*`). Worked out once per model: asking transformers tensor by
    tensor costs ~0.2 s for a 28-layer model, every publish; a fused weight (an MoE layer's experts) is left out."""
    from transformers.core_model_loading import revert_weight_conversion

    if model not in _RENAMES:
        out = {}
        for name, tensor in model.state_dict().items():
            files = list(revert_weight_conversion(model, {name: tensor}))
            if len(files) == 1:
                out[name] = files[0]
        _RENAMES[model] = out
    return _RENAMES[model]


def file_names(
    model: torch.nn.Module, pairs: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """`(name, tensor)` pairs of a model's `state_dict` in the names its checkpoint files use: transformers 5
    renames some weights in memory (a VLM's towers) and fuses others (an MoE layer's experts into 3-D tensors),
    and undoes both when it saves (`revert_weight_conversion`, applied to a fused tensor one at a time: the stream
    is never held whole)."""
    from transformers.core_model_loading import revert_weight_conversion

    renames = _renames(model)
    for name, tensor in pairs:
        if name in renames:
            yield renames[name], tensor
        else:
            yield from revert_weight_conversion(model, {name: tensor}).items()


def memory_names(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` named as the model's checkpoint files name them, renamed to its `state_dict`'s names where
    transformers renames one weight to one (a VLM's `visual.*` -> `model.visual.*`); other names pass through
    (a checkpoint written in the in-memory names loads as before). Fused weights (MoE experts) need
    `model_weights`."""
    back = {file: name for name, file in _renames(model).items()}
    return {back.get(name, name): tensor for name, tensor in weights.items()}


def model_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The weights of the HF directory `path` in the names of the model's `state_dict` (what `file_names`
    undoes), by loading it with transformers on the CPU (fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return dict(model.state_dict())


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file, or of every `*.safetensors` shard in a directory."""
    from safetensors.torch import load_file

    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out
