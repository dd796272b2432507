// Emulator stub: cuda_emu.h provides what the kernels use.
