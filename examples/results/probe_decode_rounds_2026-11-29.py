# Run on an H200, 2026-11-29 (a tenth session): the twell op in the 2B decode loop of bench_decode.py, mode
# "default", batch 8, routing on; 4 rounds, cProfile of the last. A second run changed range(4) to range(2),
# profiled round 1 and printed each thread's stack at the end (probe_decode_rounds_h200_2026-11-29_threads.log).
# Usage: python probe_decode_rounds_2026-11-29.py <path of examples/>
import sys, cProfile, pstats, io, time, collections
sys.path.insert(0, sys.argv[1])
import torch
import twell_compile
from transformers import StaticCache
from bench_model import build_model
from twell_compile.kernels import twell_mlp as tm
from twell_compile.kernels.density_route import ROUTER
counts = collections.Counter()
for name in ["_cublas_mlp", "_twell_mlp_general", "block_dense", "_activation_dense_blocks"]:
    fn = getattr(tm, name)
    def w(*a, _fn=fn, _n=name, **k):
        counts[_n] += 1
        return _fn(*a, **k)
    setattr(tm, name, w)
orig_report = ROUTER.report
def rep(*a, **k):
    counts["report"] += 1
    return orig_report(*a, **k)
ROUTER.report = rep
torch.manual_seed(0)
model = build_model(38, 24.0, 128, "cuda")
batch, warm, steps = 8, 8, 32
step = torch.compile(model.model, backend="twell")
with torch.inference_mode():
    prompt = torch.randint(0, 32000, (batch, 128), device="cuda")
    tokens = torch.randint(0, 32000, (batch, warm + steps), device="cuda")
    positions = torch.arange(128 + warm + steps, device="cuda")
    for r in range(4):
        cache = StaticCache(config=model.config, max_cache_len=128 + warm + steps)
        model.model(input_ids=prompt, past_key_values=cache, cache_position=positions[:128], use_cache=True)
        def run(a, n):
            for i in range(a, a + n):
                pos = positions[128 + i:129 + i]
                step(input_ids=tokens[:, i:i + 1], past_key_values=cache, cache_position=pos,
                     position_ids=pos.expand(batch, 1), use_cache=True)
        run(0, warm); torch.cuda.synchronize()
        counts.clear()
        prof = cProfile.Profile() if r == 3 else None
        t = time.perf_counter()
        if prof: prof.enable()
        run(warm, steps); torch.cuda.synchronize()
        if prof: prof.disable()
        print(f"round {r}: {(time.perf_counter() - t) * 1e3 / steps:.2f} ms/step, per step {({k: v / steps for k, v in counts.items()})}", flush=True)
    shares = collections.Counter((c, round(s.share or -1, 2), s.cublas) for l in ROUTER._layers.values() for c, s in l.classes.items())
    print("router layers", len(ROUTER), sorted(shares.items())[:20])
    s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18); print(s.getvalue()[-4000:])
    s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("cumtime").print_stats(25); print(s.getvalue()[-5000:])
