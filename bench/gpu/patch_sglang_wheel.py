"""Make SGLang 0.5.12's wheel import under the GPU image's transformers 5.17 (SGLang pins 5.6.0), in place.

    python3 bench/gpu/patch_sglang_wheel.py wheels/sglang-0.5.12-*.whl      # bench/gpu/wheels.sh runs it

- transformers 5.17 already registers "qwen3_asr": sglang's two AutoConfig.register calls get exist_ok=True.
- transformers 5.17 replaced `Qwen2_5_VisionRotaryEmbedding(dim, theta)` with a config-driven class; sglang's
  Qwen2.5-VL imports the old one, the import fails, and SGLang silently serves the model through its
  transformers backend, which refuses it ("Unsupported TP style 'embedding_rowwise'"). The old class (its
  transformers 5.6.0 text: inverse frequencies and their outer product with the positions) is defined in
  sglang's module instead.
- SGLang 0.5.12 decodes a VLM prompt sent as token ids to text and serves the processor's re-tokenization of
  it, which is not always the ids sent (random ids, or a sampled reply's non-canonical tokens in a later turn):
  the model then runs on another prompt than the one recorded. SGLang 0.5.13 keeps the ids sent and expands
  only the image placeholders (`SGLANG_MM_AVOID_RETOKENIZE`, on by default); the same for the Qwen-VL
  processor here, each image's token count from the processor's own grid.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import sys
import zipfile

OLD_ROPE = """

class Qwen2_5_VisionRotaryEmbedding(nn.Module):  # transformers 5.6.0's (agentrl: 5.17 renamed and changed it)
    def __init__(self, dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.dim = dim
        self.theta = theta
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, seqlen: int) -> torch.Tensor:
        seq = torch.arange(seqlen, device=self.inv_freq.device, dtype=self.inv_freq.dtype)
        return torch.outer(seq, self.inv_freq)
"""


def asr(text: str) -> str:
    pattern = r'AutoConfig\.register\(("qwen3_asr(?:_thinker)?"), (\w+)\)'
    new = re.sub(pattern, r"AutoConfig.register(\1, \2, exist_ok=True)", text)
    assert new.count("exist_ok=True") == 2, "sglang's qwen3_asr registrations moved"
    return new


def qwen2_5_vl(text: str) -> str:
    old_import = "    Qwen2_5_VisionPatchEmbed,\n    Qwen2_5_VisionRotaryEmbedding,\n)\n"
    assert old_import in text, "sglang's Qwen2.5-VL imports moved"
    text = text.replace(old_import, "    Qwen2_5_VisionPatchEmbed,\n)\n", 1)
    anchor = "\nlogger = "  # after the imports: the class needs nn and torch only
    at = text.index(anchor) if anchor in text else text.index("\nclass ")
    return text[:at] + OLD_ROPE + text[at:]


KEEP_IDS = """

def _agentrl_keep_ids(sent, ret, image_token_id, processor):  # agentrl: SGLang 0.5.13's token preservation
    \"\"\"The ids sent, each image placeholder expanded to its image's token count (the processor's grid).\"\"\"
    grids = ret["image_grid_thw"]
    merge = int(getattr(processor.image_processor, "merge_size", 2))
    counts = [int(n) for n in (grids.prod(-1) // merge**2).tolist()]
    if sum(1 for t in sent if t == image_token_id) != len(counts):
        raise ValueError(f"{len(counts)} images for another number of placeholders in the ids sent")
    out, at = [], 0
    for t in sent:
        if t == image_token_id:
            out += [image_token_id] * counts[at]
            at += 1
        else:
            out.append(t)
    return out
"""
KEEP_IDS_CALL = """            all_collected_items = collected_items
            sent = getattr(base_output, "input_ids", None)  # agentrl: the ids sent, not their re-tokenization
            if (sent is not None and raw_images and not raw_audios and not raw_videos
                    and os.environ.get("SGLANG_MM_AVOID_RETOKENIZE", "1").lower() not in ("0", "false")):
                try:
                    input_ids = torch.tensor(_agentrl_keep_ids(sent, ret, mm_tokens.image_token_id,
                                                               self._processor), dtype=input_ids.dtype)
                except Exception as e:
                    logger.warning(f"Due to {e}, serving the re-tokenized prompt (token drift).")
"""


def keep_ids_base(text: str) -> str:
    anchor = "            all_collected_items = collected_items\n"
    assert text.count(anchor) == 1 and "logger" in text, "sglang's process_and_combine_mm_data moved"
    return text.replace(anchor, KEEP_IDS_CALL, 1) + KEEP_IDS


def keep_ids_qwen_vl(text: str) -> str:
    anchor = (
        "            multimodal_tokens=self.mm_tokens,\n        )\n        load_time = time.perf_counter()\n"
    )
    assert text.count(anchor) == 1, "sglang's Qwen-VL process_mm_data_async moved"
    keep = "        base_output.input_ids = input_text if isinstance(input_text, list) else None  # agentrl\n"
    return text.replace(anchor, anchor.replace("        load_time", keep + "        load_time"), 1)


PATCHES = {  # file -> its patches
    "sglang/srt/configs/qwen3_asr.py": [asr],
    "sglang/srt/models/qwen2_5_vl.py": [qwen2_5_vl],
    "sglang/srt/multimodal/processors/base_processor.py": [keep_ids_base],
    "sglang/srt/multimodal/processors/qwen_vl.py": [keep_ids_qwen_vl],
}


def record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def patch(src: str) -> None:
    zin = zipfile.ZipFile(src)
    new = {}
    for name, fixes in PATCHES.items():
        text = out = zin.read(name).decode()
        # a patch writes "agentrl" into its file, so a patched file is left alone (asr's writes no mark: it
        # re-applies to its own output unchanged)
        if "agentrl" not in text:
            for fix in fixes:
                out = fix(out)
        if out != text:
            new[name] = out.encode()
    if not new:
        print(f"{src}: already patched")
        return
    rec = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
    lines = [
        record_line(line.split(",")[0], new[line.split(",")[0]]) if line.split(",")[0] in new else line
        for line in zin.read(rec).decode().splitlines()
    ]
    tmp = src + ".tmp"
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        for info in zin.infolist():
            data = new.get(info.filename)
            if info.filename == rec:
                data = ("\n".join(lines) + "\n").encode()
            z.writestr(info, data if data is not None else zin.read(info.filename))
    os.replace(tmp, src)
    print(f"{src}: patched {', '.join(new)}")


if __name__ == "__main__":
    for path in sys.argv[1:]:
        patch(path)
