"""Kernel orchestration: candidate fused kernels, their costs, the binary linear program that picks kernel boundaries (and the greedy baseline), the kernel order and static memory plan."""
