"""The lab's own CPU kernels (C++ sources compiled on first use) and MindSpore custom operators over them."""
