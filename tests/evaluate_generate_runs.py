"""The checkpoints tests/test_evaluate.py, tests/test_evaluate_parallel.py and tests/test_generate.py share: each is
made once per test session, when a test first asks for it: in one process, under pytest's temporary directory;
under pytest-xdist (whose workers share no fixture), the first worker to ask makes it under a file lock in the
session's shared directory and the others wait and use it.

* ``trained(factory, name)``: a proxy trained by the `nemo` command in this process, 2 iterations, saved and
  validated (1 global batch) at each; ``demo``: the Kimi K2 proxy exactly as ``make demo`` trains it (the
  Makefile's own ``demo`` command line, read from the Makefile) with 2 iterations, validated at iteration 2.
* ``exported(factory, name)``: its ``nemo llm export``.
* ``imported(factory)``: a tiny Qwen3 HF directory (tests/hf_fixtures.py) and its ``nemo llm import``.
* ``transformers_greedy(hf, prompt, new)``: the reference for generate; ``printed_validation(ckpt)``: the one for
  evaluate (what the training loop printed).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import hf_fixtures
from session_once import once_per_session
from tests.nemo_cli import call_nemo

ROOT = Path(__file__).resolve().parent.parent
SAVE_AND_VALIDATE_EACH = ["train.train_iters=2", "checkpoint.save_interval=1", "train.eval_interval=1",
                          "train.eval_iters=1", "logger.log_interval=1"]
# the demo's own flags, 2 iterations instead of its 50, one validation pass at the end (the number evaluate matches)
DEMO_TINY = ["train.train_iters=2", "train.eval_interval=2", "train.eval_iters=1", "logger.log_interval=1"]
RECIPES = {"qwen3": "qwen3_proxy_muon", "adamw": "qwen3_proxy_adamw", "qwen3_moe": "qwen3_moe_proxy_muon",
           "moonlight": "moonlight_proxy_muon"}



def demo_command(run_dir: Path) -> list[str]:
    """The arguments after ``nemo`` of the Makefile's ``demo`` target, with ``$(DEMO_RUN)`` = ``run_dir``."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    recipe = re.search(r"^demo:.*\n\t(.*)$", text, re.MULTILINE)
    assert recipe, "the Makefile has no demo target"
    argv = shlex.split(recipe[1].replace("$(DEMO_RUN)", str(run_dir)))
    assert argv[0].endswith("/bin/nemo") and argv[1:3] == ["llm", "pretrain"], argv
    return argv[1:]


def trained(factory, name: str) -> Path:
    """The checkpoint root (``checkpoint.save``) of the run ``name`` (the module's docstring)."""

    def make(root: Path) -> Path:
        if name == "demo":
            argv = [*demo_command(root / "demo"), *DEMO_TINY]
            ckpt = root / "demo" / "checkpoints"
            assert f"checkpoint.save={ckpt}" in argv
        else:
            ckpt = root / RECIPES[name]
            argv = ["llm", "pretrain", "--recipe", RECIPES[name], f"checkpoint.save={ckpt}", *SAVE_AND_VALIDATE_EACH]
        assert call_nemo(argv, capture=None, cwd=root).code == 0
        return ckpt

    return once_per_session(factory, name, make)


def exported(factory, name: str) -> Path:
    """``nemo llm export`` of :func:`trained` ``name`` (its latest iteration)."""
    ckpt = trained(factory, name)

    def make(root: Path) -> Path:
        assert call_nemo(["llm", "export", "--ckpt", ckpt, "--out", root / "hf"], capture=None).code == 0
        return root / "hf"

    return once_per_session(factory, f"{name}/hf", make)


def imported(factory) -> dict[str, Path]:
    """``{"hf": a tiny Qwen3 HF directory with its tokenizer, "ckpt": its nemo llm import}``."""

    def make(root: Path) -> dict[str, Path]:
        hf = hf_fixtures.qwen3_dir(root / "hf")
        assert call_nemo(["llm", "import", "--hf", hf, "--out", root / "mg"], capture=None).code == 0
        return {"hf": hf, "ckpt": root / "mg"}

    return once_per_session(factory, "import", make)


def transformers_greedy(hf: Path, prompt: str | list[str], new: int) -> list[int] | list[list[int]]:
    """The reference: transformers' own greedy generate() on an HF directory (an export, an import's source), the
    tokenizer from that directory; one prompt at a time (a list of prompts: the model loaded once)."""
    import torch
    from transformers import AutoModelForCausalLM

    from bridge_ext.hf import load_hf_config
    from bridge_ext.tokenizers import load_tokenizer

    tok = load_tokenizer(hf)
    model = AutoModelForCausalLM.from_pretrained(hf, config=load_hf_config(hf), dtype=torch.float32)
    out = []
    for text in [prompt] if isinstance(prompt, str) else prompt:
        ids = torch.tensor([tok.encode(text)])
        generated = model.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=tok.eod,
                                   pad_token_id=tok.eod, attention_mask=torch.ones_like(ids))
        out.append(generated[0, ids.shape[1]:].tolist())
    return out[0] if isinstance(prompt, str) else out


def printed_validation(ckpt: Path) -> dict[int, list[tuple[str, str]]]:
    """What the training loop printed: iteration -> [(loss, PPL)] as Megatron Bridge formats them (upstream.log
    keeps the run's full output)."""
    found: dict[int, list[tuple[str, str]]] = {}
    pattern = re.compile(r"validation loss at iteration (\d+) \| lm loss value: (\S+) \| lm loss PPL: (\S+) \|")
    for match in pattern.finditer((ckpt / "upstream.log").read_text()):
        found.setdefault(int(match[1]), []).append((match[2], match[3]))
    return found
