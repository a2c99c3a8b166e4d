"""The host side of tridist: the world and its (virtual) nodes (`world`), process groups
(`groups`), the backend chosen at import (`backend`), the symmetric heap and tensors (`heap`,
`tensors`), the `jit` decorator, the emulator and the NVSHMEM transport, the launcher behind
`tridist run`, the compile log behind `tridist precompile` (`compiles`), the autotuner (`tune`), the
settings (`config`) and the `tridist` logger (`log`). `tridist` re-exports what users call."""
