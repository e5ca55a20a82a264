"""The `kai-isolator dev --demo` walk-through and its demo kubelet (fixtures, not services)."""
