"""The vision service (``k3 serve vision``): images and videos to visual tokens, cached by content hash.

``config`` holds the service configuration, ``cache`` the token caches (cache store or in-process) and
``service`` the ``k3.v1.Vision`` servicer with its ``SPEC``.
"""
