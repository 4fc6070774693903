"""Where in native code a crashing call dies: runs one call in a child process with a SIGSEGV, SIGABRT and
SIGBUS handler that prints the native backtrace, then resolves the frames with addr2line.

    python examples/probe_native_crash.py [M [F]]   # default M 300, F 7.3 million

The call is the private step-by-step path (``_twell_mlp_general``) at K 16, D 24 and intermediate size F,
the call that crashed two pytest runs on 2026-11-30 (examples/results/README.md, "The targets rerun on
the last code"). That path now refuses sizes past the kernels' limits with a ValueError before any
launch, so at the defaults the probe prints that; edit CHILD to probe another call. The handler replaces
Python's faulthandler and torch's own, so a crash that depends on those may not reproduce here.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import textwrap

HANDLER = r"""
#include <execinfo.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
static void on_signal(int sig) {
  void* frames[96];
  const int n = backtrace(frames, 96);
  const char* head = "native backtrace:\n";
  if (write(2, head, strlen(head)) < 0) _exit(128 + sig);
  backtrace_symbols_fd(frames, n, 2);
  _exit(128 + sig);
}
extern "C" void install_native_backtrace(void) {
  void* warm[1];
  backtrace(warm, 1);  // loads libgcc now: backtrace's first call may allocate, unsafe in a handler
  static stack_t alt;  // a stack of its own, so that a stack overflow is caught too
  alt.ss_sp = malloc(1 << 16);
  alt.ss_size = 1 << 16;
  sigaltstack(&alt, 0);
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sa.sa_flags = SA_ONSTACK;
  sigaction(SIGSEGV, &sa, 0);
  sigaction(SIGABRT, &sa, 0);
  sigaction(SIGBUS, &sa, 0);
}
"""

CHILD = """
import ctypes, sys, torch
from twell_compile.kernels import build, twell_mlp
from twell_compile.testing import make_problem
ext = build.cuda_extension()
print("extension", ext.__file__, flush=True)
ctypes.CDLL(sys.argv[1]).install_native_backtrace()
m, f = int(sys.argv[2]), int(sys.argv[3])
p = make_problem(m, 16, f, 24, nnz_per_row=24.0, gated=True, bias=True)
a = (p.x, p.gate_weight, p.gate_bias, p.up_weight, p.up_bias, p.down_weight, p.down_bias)
print("calling _twell_mlp_general", m, f, [tuple(t.shape) if t is not None else None for t in a], flush=True)
try:
    out = twell_mlp._twell_mlp_general(*a)
    torch.cuda.synchronize()
    print("returned", type(out), flush=True)
except Exception as e:
    print("raised", type(e).__name__, str(e)[:400], flush=True)
"""


def main() -> None:
    m = sys.argv[1] if len(sys.argv) > 1 else "300"
    f = sys.argv[2] if len(sys.argv) > 2 else "7300000"
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = os.path.join(tmp, "h.cpp"), os.path.join(tmp, "libh.so")
        with open(src, "w") as handle:
            handle.write(HANDLER)
        subprocess.run(["g++", "-shared", "-fPIC", "-O1", src, "-o", lib], check=True)
        proc = subprocess.run([sys.executable, "-c", CHILD, lib, m, f], capture_output=True, text=True, timeout=900)
    text = proc.stdout + proc.stderr
    print(text[-6000:])
    print("exit status", proc.returncode)
    for line in text.splitlines():
        hit = re.match(r"(\S+\.so[^(]*)\(([^)]*)\)", line)
        if not hit or "+0x" not in hit.group(2):
            continue
        path, sym = hit.group(1), hit.group(2)
        off = sym.split("+", 1)[1]
        if sym.startswith("+"):
            res = subprocess.run(["addr2line", "-C", "-f", "-e", path, off], capture_output=True, text=True).stdout
            print(f"{os.path.basename(path)} {off}: {' | '.join(res.split())[:300]}")
        else:
            name = subprocess.run(["c++filt", sym.split("+")[0]], capture_output=True, text=True).stdout.strip()
            print(f"{os.path.basename(path)} {name[:300]} +{off}")


if __name__ == "__main__":
    main()
