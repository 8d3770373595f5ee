"""Make SGLang 0.5.12's wheel import under the GPU image's transformers 5.17 (SGLang pins 5.6.0), in place.

    python3 bench/gpu/patch_sglang_wheel.py wheels/sglang-0.5.12-*.whl      # bench/gpu/wheels.sh runs it

- transformers 5.17 already registers "qwen3_asr": sglang's two AutoConfig.register calls get exist_ok=True.
- transformers 5.17 replaced `Qwen2_5_VisionRotaryEmbedding(dim, theta)` with a config-driven class; sglang's
  Qwen2.5-VL imports the old one, the import fails, and SGLang silently serves the model through its
  transformers backend, which refuses it ("Unsupported TP style 'embedding_rowwise'"). The old class (its
  transformers 5.6.0 text: inverse frequencies and their outer product with the positions) is defined in
  sglang's module instead.
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


PATCHES = {"sglang/srt/configs/qwen3_asr.py": asr, "sglang/srt/models/qwen2_5_vl.py": qwen2_5_vl}


def record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def patch(src: str) -> None:
    zin = zipfile.ZipFile(src)
    if b"agentrl: 5.17" in zin.read("sglang/srt/models/qwen2_5_vl.py"):
        print(f"{src}: already patched")
        return
    new = {name: fix(zin.read(name).decode()).encode() for name, fix in PATCHES.items()}
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
    print(f"{src}: patched {', '.join(PATCHES)}")


if __name__ == "__main__":
    for path in sys.argv[1:]:
        patch(path)
