"""Regenerate tests/engine/pinned_default_model.json from the reference commit's code.

    python tools/record_pinned_outputs.py --model DIR --out tests/engine/pinned_default_model.json

The pins must never come from the code under test, so this script checks out ``--ref`` (default
0dc7015, main before the provider/platform/registry refactor) into a temporary git worktree,
applies REF_PATCH there, and runs the generation in a subprocess whose ``PYTHONPATH`` is that
worktree: the old ``vllm`` package, the old ``tools/quantize_checkpoint.py``, and the old C
kernels. ``vllm/kernels/cpu/build.py`` keys its library by a hash of the sources, flags, compiler
and CPU, so the patched old sources get their own build; the subprocess also gets a private
``VLLM_CACHE_ROOT`` so nothing is shared with the current tree's cache.

It does what tests/engine/test_pinned_outputs.py does (prompts, max_tokens and config keys read
from the existing pins file, QUANT_ARGS read from the test): greedy, one thread (as
tests/conftest.py sets), every sampled step's logits recorded at Sampler.sample and hashed in
order with the test's ``_digest``; the machine signature as the test's ``machine_signature``.
Keys are ``<dtype>-<backend>`` (moe_backend=backend) or ``bfloat16-<scheme>`` (a checkpoint
quantized by the reference commit's tool with QUANT_ARGS[scheme], run with moe_backend="torch").
Full run: about 45 s on the 2-core dev machine (20 s of it compiling the old C kernels).
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PINS = os.path.join(ROOT, "tests", "engine", "pinned_default_model.json")
TEST = os.path.join(ROOT, "tests", "engine", "test_pinned_outputs.py")

# Commit bd252dd (CPU kernels built with -ffp-contract=off, every fma explicit) changed the bits
# of one kernel path on the recording machine: the f32 paged-attention specialisation for G=2,
# D=64 (the default model's shape: 4 query heads, 2 KV heads, head_dim 64), which GCC had
# contracted differently from the generic path. Its three float32 digests were re-recorded from
# the reference sources with that specialisation disabled, i.e. f32 with G=2, D=64 takes the
# generic ATTEND(0, G, D); the bf16 specialisation stays. This is that change.
REF_PATCH = """\
--- a/vllm/kernels/cpu/paged_attention.c
+++ b/vllm/kernels/cpu/paged_attention.c
@@ -205,8 +205,7 @@ static void attend_any(const void *q, const void *keys, const void *values, cons
         else if (G == 4 && D == 128) ATTEND(1, 4, 128);
         else ATTEND(1, G, D);
     } else {
-        if (G == 2 && D == 64) ATTEND(0, 2, 64);
-        else if (G == 4 && D == 128) ATTEND(0, 4, 128);
+        if (G == 4 && D == 128) ATTEND(0, 4, 128);
         else ATTEND(0, G, D);
     }
 }
"""
PATCH_NOTE = ("vllm/kernels/cpu/paged_attention.c: the f32 (G=2, D=64) attention specialisation "
              "disabled (f32 always takes the generic ATTEND(0, G, D); see bd252dd)")


def quant_args() -> dict[str, list[str]]:
    """QUANT_ARGS as the test defines it (read, not imported: importing it imports vllm)."""
    for node in ast.parse(open(TEST).read()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "QUANT_ARGS":
            return ast.literal_eval(node.value)
    raise SystemExit(f"QUANT_ARGS not found in {TEST}")


def worker(model: str, spec: dict, out: str) -> None:
    """Runs inside the subprocess, importing everything from the reference worktree (cwd)."""
    wt = os.getcwd()
    sys.path[0] = wt                                   # not this script's folder
    import torch
    torch.set_num_threads(1)                           # as tests/conftest.py
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.worker import sampler as sampler_mod
    from tools.quantize_checkpoint import main as quantize_main
    for mod in (vllm, sys.modules["tools.quantize_checkpoint"]):
        assert os.path.realpath(mod.__file__).startswith(os.path.realpath(wt)), mod.__file__

    def generate(path: str, **kw):                     # the test's _generate
        seen = []
        # The runner calls Sampler.sample since async scheduling; __call__ in older trees.
        name = "sample" if hasattr(sampler_mod.Sampler, "sample") else "__call__"
        call = getattr(sampler_mod.Sampler, name)

        def recording(self, logits, *a, **k):
            seen.append(logits.detach().clone())
            return call(self, logits, *a, **k)
        setattr(sampler_mod.Sampler, name, recording)
        try:
            params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True)
            outs = LLM(path, device="cpu", **kw).generate(spec["prompts"], params)
        finally:
            setattr(sampler_mod.Sampler, name, call)
        return [list(o.outputs[0].token_ids) for o in outs], seen

    def digest(logits) -> str:                         # the test's _digest
        h = hashlib.sha256()
        for t in logits:
            h.update(t.contiguous().numpy().tobytes())
        return h.hexdigest()[:16]

    flags = ""                                         # the test's machine_signature
    if os.path.isfile("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    key = f"{torch.__version__}|{flags.strip()}|{os.environ.get('VLLM_CPU_KERNELS', '')}"
    result = {"machine_signature": hashlib.sha256(key.encode()).hexdigest()[:16], "configs": {}}
    qroot = os.path.join(os.path.dirname(out), "quant")   # inside the caller's temp dir
    for name in spec["keys"]:
        dtype, rest = name.split("-", 1)
        t0 = time.time()
        if rest in spec["quant_args"]:
            path = os.path.join(qroot, rest)
            quantize_main(["--model", model, "--out", path, "--scheme", rest.split("-asym")[0],
                           *spec["quant_args"][rest]])
            tokens, logits = generate(path, dtype=dtype, moe_backend="torch")
        else:
            tokens, logits = generate(model, dtype=dtype, moe_backend=rest)
        result["configs"][name] = {"logits_sha256": digest(logits), "tokens": tokens}
        print(f"{name}: {digest(logits)} ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    json.dump(result, open(out, "w"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=os.path.join(ROOT, "vllm", "models", "default"))
    p.add_argument("--ref", default="0dc7015", help="commit whose code records the pins")
    p.add_argument("--pins", default=PINS, help="pins file giving prompts, max_tokens, keys")
    p.add_argument("--out", default=PINS, help="where to write the new pins")
    p.add_argument("--_worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    model = os.path.abspath(args.model)
    if args._worker:
        return worker(model, json.load(open(args._worker[0])), args._worker[1])

    old = json.load(open(args.pins))
    qa = quant_args()
    keys = list(old["configs"])
    sha = hashlib.sha256(open(os.path.join(model, "model.safetensors"), "rb").read()).hexdigest()
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", args.ref], check=True,
                            capture_output=True, text=True).stdout.strip()
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="pinref-") as tmp:
        wt = os.path.join(tmp, "wt")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "-q", wt, commit],
                       check=True)
        try:
            subprocess.run(["git", "-C", wt, "apply", "-"], input=REF_PATCH, text=True,
                           check=True)
            spec = os.path.join(tmp, "spec.json")
            json.dump({"prompts": old["prompts"], "max_tokens": old["max_tokens"], "keys": keys,
                       "quant_args": qa}, open(spec, "w"))
            env = {**os.environ, "PYTHONPATH": wt,
                   "VLLM_CACHE_ROOT": os.path.join(tmp, "cache")}
            res = os.path.join(tmp, "result.json")
            subprocess.run([sys.executable, os.path.abspath(__file__), "--model", model,
                            "--_worker", spec, res], cwd=wt, env=env, check=True)
            new = json.load(open(res))
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", wt], check=True)
    shown = os.path.relpath(model, ROOT) if model.startswith(ROOT + os.sep) else "the default model"
    source = (f"recorded by tools/record_pinned_outputs.py from main at commit {commit[:7]} "
              f"({commit}; before the CachedWeightProvider / platform / registry refactor), "
              f"its own tools/quantize_checkpoint.py making the quantized checkpoints, with one "
              f"patch: {PATCH_NOTE}. Model: {shown} (model.safetensors sha256 {sha}). Greedy, "
              f"every sampled step's f32 logits hashed in order")
    configs = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in new["configs"].items())
    with open(args.out, "w") as f:             # the checked-in layout: one config a line
        f.write("{\n" + f' "_source": {json.dumps(source)},\n'
                f' "machine_signature": {json.dumps(new["machine_signature"])},\n'
                f' "prompts": {json.dumps(old["prompts"])},\n'
                f' "max_tokens": {json.dumps(old["max_tokens"])},\n'
                ' "configs": {\n' + configs + "\n }\n}\n")
    print(f"wrote {args.out} in {time.time() - t0:.0f} s; machine signature "
          f"{new['machine_signature']} (pins file had {old['machine_signature']})")


if __name__ == "__main__":
    main()
