"""Node agent: installs libvgpu.so on its node, inspects containers and exports their usage."""
