"""Where the work runs: ZeroGPU calls and their emulation, a second device emulated on the CPU, and the one synchronised timer."""
