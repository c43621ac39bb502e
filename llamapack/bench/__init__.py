"""``llamapack bench``: the same model and prompts under vanilla llama.cpp (experts in VRAM; ``--cpu-moe``;
``--cpu-moe`` under a memory limit the experts do not fit in) and llamapack (pack, GGUF-direct, VRAM
caches of a few sizes), side by side in one run, reported as ratios.

Layout: ``configs`` (the matrix, pure), ``workload`` (prompts), ``worker`` (one configuration in its own
process), ``cgroup`` (memory limits), ``diskbw`` (the disk's bandwidth for expert reads), ``runner`` (the
whole run), ``report`` (derived numbers, ratios, markdown, plot).
"""
