"""Which errors can a freshly built torch extension raise on this machine? Each variant runs in
its own process, so one that crashes (rc -11: SIGSEGV) does not hide the others. Output of the
run on the H100 machine: 19_cpp_exception_probe.txt."""

import os
import subprocess
import sys

SOURCE = r'''
#include <torch/extension.h>
#include <sstream>
namespace py = pybind11;
void a_literal(int64_t x) { throw std::runtime_error("bad"); }
void b_string(int64_t x) { throw std::runtime_error(std::string("bad ") + std::to_string(x)); }
void c_c10str(int64_t x) { throw std::runtime_error(c10::str("bad x ", x)); }
std::string d_stream(int64_t x) { std::ostringstream s; s << "x " << x; return s.str(); }
void e_torch_check(int64_t x) { TORCH_CHECK(x < 0, "bad x ", x); }
void f_torch_check_plain(int64_t x) { TORCH_CHECK(x < 0, "bad"); }
void g_value_error(int64_t x) { throw py::value_error("bad"); }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("a_literal", &a_literal, py::call_guard<py::gil_scoped_release>());
  m.def("b_string", &b_string, py::call_guard<py::gil_scoped_release>());
  m.def("c_c10str", &c_c10str, py::call_guard<py::gil_scoped_release>());
  m.def("d_stream", &d_stream, py::call_guard<py::gil_scoped_release>());
  m.def("e_torch_check", &e_torch_check);
  m.def("f_torch_check_plain", &f_torch_check_plain);
  m.def("g_value_error", &g_value_error);
}
'''
FLAGS = {"native": ["-O3", "-march=native", "-fopenmp"], "plain": ["-O2"]}
VARIANTS = ("a_literal", "b_string", "c_c10str", "d_stream", "e_torch_check", "f_torch_check_plain", "g_value_error")
TORCH_OWN = "import torch\ntry: torch.zeros(2).view(3)\nexcept RuntimeError: print('torch own error ok')"


def load(flavour: str):
    from torch.utils.cpp_extension import load_inline
    directory = f"/tmp/probe2_{flavour}"
    os.makedirs(directory, exist_ok=True)
    return load_inline(f"probe2_{flavour}", cpp_sources=[SOURCE], extra_cflags=FLAGS[flavour],
                       build_directory=directory)


def main() -> None:
    if len(sys.argv) == 3:  # one variant, in a child process
        module = load(sys.argv[1])
        try:
            print("returned", getattr(module, sys.argv[2])(5))
        except (RuntimeError, ValueError) as e:
            print(type(e).__name__, str(e).splitlines()[0])
        return
    for flavour in FLAGS:
        load(flavour)
        for name in VARIANTS:
            r = subprocess.run([sys.executable, __file__, flavour, name], capture_output=True, text=True)
            print(f"{flavour:6s} {name:20s} rc {r.returncode} {r.stdout.strip()[-60:]}", flush=True)
    r = subprocess.run([sys.executable, "-c", TORCH_OWN], capture_output=True, text=True)
    print("torch's own c10::Error:", r.returncode, r.stdout.strip())


if __name__ == "__main__":
    main()
