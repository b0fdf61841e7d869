"""SiTU-GLU activation kernels.

``reference`` wraps the model's definition (:func:`k3.model.situ.situ_glu`) for a packed ``[..., 2 * I]`` input;
``triton`` holds the fused forward/backward kernels and their autograd Function. The Triton module is not
imported here, so importing this package never pulls in Triton.
"""

from k3.kernels.situ.reference import situ_glu_reference

__all__ = ["situ_glu_reference"]
