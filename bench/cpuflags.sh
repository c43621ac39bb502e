# Sourced by the scripts that build CUDA binaries on one machine for the device machine to run (ggml's CPU backend
# is compiled with -march=native there): the flags that matter, and those a build needs that this CPU lacks.
cpu_flags() {  # this CPU's SIMD flags, one a line, sorted under C collation (comm needs one collation)
    grep -o -w -E 'avx[0-9a-z_]*|amx[a-z_]*|f16c|fma|bmi2' /proc/cpuinfo | LC_ALL=C sort -u
}
missing_cpu_flags() {  # $1: a build's flags file; prints the flags this CPU lacks, space-separated (nothing: none)
    [ -f "$1" ] || return 0
    cpu_flags | LC_ALL=C comm -13 - <(LC_ALL=C sort -u "$1") | tr '\n' ' '
}
