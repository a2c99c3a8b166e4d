"""The host side of tridist: the world and its (virtual) nodes (`world`), the backend chosen at
import (`backend`), the symmetric heap and tensors (`heap`, `tensors`), the `jit` decorator, the
emulator and the NVSHMEM transport, the launcher behind `tridist run`, the autotuner (`tune`) and
the settings (`config`). `tridist` re-exports what users call."""
