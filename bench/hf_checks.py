"""What checking a Hugging Face directory from someone else costs (docs/conversion.md, "Hugging Face directories
from someone else").

    .venv/bin/python bench/hf_checks.py [--shards 20] [--tensors 2000] [--mb 512]

* headers: ``read_safetensors_header`` over ``--shards`` files of ``--tensors`` small tensors each (a header of
  ~100 bytes per tensor, as released checkpoints have), files in the page cache; per file and per tensor;
* config: ``check_config_sizes`` + the parameter estimate of the shipped Kimi K2 config (61 layers, 384 experts);
* finite: ``check_finite`` (one ``sum``) against ``torch.isfinite(t).all()`` on a ``--mb`` MB tensor in bf16 and
  fp32, GB/s, best of 3.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _best(fn, repeat: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def headers(shards: int, tensors: int) -> None:
    from bridge_ext.hf.directory import read_safetensors_header

    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for shard in range(shards):
            header, offset = {"__metadata__": {"format": "pt"}}, 0
            for n in range(tensors):
                header[f"model.layers.{n // 16}.mlp.experts.{n % 16}.down_proj.weight"] = {
                    "dtype": "BF16", "shape": [4, 8], "data_offsets": [offset, offset + 64]}
                offset += 64
            raw = json.dumps(header).encode()
            file = Path(tmp) / f"model-{shard:05d}.safetensors"
            file.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))
            files.append(file)
        header_bytes = sum(struct.unpack("<Q", f.read_bytes()[:8])[0] for f in files)
        seconds = _best(lambda: [read_safetensors_header(f) for f in files])
        print(f"headers: {shards} files x {tensors} tensors ({header_bytes / shards / 1e3:.0f} KB of header each): "
              f"{seconds * 1e3:.1f} ms, {seconds / shards * 1e3:.2f} ms per file, "
              f"{seconds / (shards * tensors) * 1e6:.2f} us per tensor")


def config() -> None:
    from bridge_ext.hf.untrusted import check_config_sizes
    from recipes.architecture import Architecture
    from recipes.params import count_params

    file = REPO / "recipes" / "hf_configs" / "kimi_k2" / "config.json"
    raw = json.loads(file.read_text())

    def run() -> int:
        check_config_sizes(raw, where=file)
        return count_params(Architecture.from_hf_config(raw)).total

    seconds = _best(run)
    print(f"config: Kimi K2 ({run() / 1e12:.3f} T parameters): caps + estimate {seconds * 1e3:.2f} ms")


def finite(mb: int) -> None:
    import torch

    from bridge_ext.hf.untrusted import check_finite

    print(f"finite: torch {torch.__version__}, {torch.get_num_threads()} threads")
    for dtype in (torch.bfloat16, torch.float32):
        t = torch.randn(mb * 2**20 // 4, dtype=torch.float32).to(dtype)
        if dtype == torch.bfloat16:
            t = torch.cat([t, t])
        gb = t.numel() * t.element_size() / 1e9
        ours = _best(lambda: check_finite(t, name="t", file=Path("f")))
        plain = _best(lambda: bool(torch.isfinite(t).all()))
        print(f"finite: {str(dtype).removeprefix('torch.')} {gb:.2f} GB: check_finite {gb / ours:.1f} GB/s, "
              f"isfinite(t).all() {gb / plain:.2f} GB/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=20)
    parser.add_argument("--tensors", type=int, default=2000)
    parser.add_argument("--mb", type=int, default=512)
    args = parser.parse_args()
    headers(args.shards, args.tensors)
    config()
    finite(args.mb)


if __name__ == "__main__":
    main()
