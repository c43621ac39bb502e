"""llamapack: run MoE LLMs whose experts do not fit in memory, streaming experts from SSD, losslessly.

The patched llama-cpp-python it runs on is built by ``python scripts/build_llama.py`` (see README).
"""
from setuptools import find_packages, setup

setup(
    name="llamapack",
    version="0.1.0",
    description="Serve Mixture-of-Experts LLMs with routed experts streamed from SSD through a patched llama.cpp",
    packages=find_packages(include=["llamapack", "llamapack.*"]),
    package_data={"llamapack.server": ["static/*"], "llamapack.routing": ["data/*"]},
    python_requires=">=3.10",
    setup_requires=["cffi>=1.15"],
    cffi_modules=["native/build_ffi.py:ffibuilder"],
    # llama-cpp-python itself is built and installed by scripts/build_llama.py (patched); its runtime
    # dependencies are listed here because that install skips dependency resolution
    install_requires=["numpy", "gguf==0.19.0", "cffi>=1.15", "click>=8", "flask>=3", "waitress>=3", "tqdm",
                      "diskcache>=5.6.1", "jinja2>=2.11.3", "typing-extensions>=4.5.0"],
    extras_require={
        "test": ["pytest", "hypothesis", "openai", "selenium", "matplotlib"],
        "cuda12": ["cupy-cuda12x"],
        "cuda13": ["cupy-cuda13x"],
    },
    entry_points={"console_scripts": ["llamapack=llamapack.cli:main"]},
)
