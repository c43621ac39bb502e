#!/usr/bin/env bash
# Linkage facts behind the numpy-import-order crash (bench/numpy_import_order.sh): which C++ runtime symbols
# the CUDA libggml exports, what each library needs, and which libstdc++ a numpy import maps.
# Usage: bash bench/libstdcxx_facts.sh BUILD_DIR/patched
lib="$1"
echo "== NEEDED"; for f in libllama.so libggml.so libggml-base.so libggml-cuda.so libggml-cpu.so; do
    echo "-- $f"; readelf -d "$lib/$f" 2>&1 | grep -E "NEEDED|RUNPATH|SONAME"; done
echo "== std:: symbols libggml-cuda defines (dynamic table)"
nm -D --defined-only "$lib/libggml-cuda.so" | c++filt | grep -c "std::"
nm -D --defined-only "$lib/libggml-cuda.so" | c++filt | grep -E "std::basic_ostream|std::locale|ios_base|codecvt|num_put" | head -20
echo "== the same in libllama.so"; nm -D --defined-only "$lib/libllama.so" | c++filt | grep -c "std::"
echo "== undefined _M_insert in libllama.so"; nm -D --undefined-only "$lib/libllama.so" | c++filt | grep "_M_insert" | head
echo "== numpy"
python3 -c "import numpy; print(numpy.__version__, numpy.__file__); print(''.join(l for l in open('/proc/self/maps') if 'stdc++' in l or 'gcc_s' in l or '.libs' in l))"
echo "== compilers"; gcc --version | head -1; nvcc --version | tail -2; ls /usr/lib/x86_64-linux-gnu/libstdc++.so.6*
echo "== GLIBCXX versions required by libggml-cuda"; objdump -T "$lib/libggml-cuda.so" | grep -o "GLIBCXX_[0-9.]*" | sort -uV | tail -3
echo "== where the C++ driver finds the runtime"; for n in libstdc++.so libstdc++.a libstdc++.so.6; do echo "$n: $(c++ -print-file-name=$n)"; done
ls -la /usr/lib/x86_64-linux-gnu/ | grep "stdc++"; ls -la "$(dirname "$(c++ -print-file-name=libstdc++.a)")" | grep "stdc++"
