"""Latency of the vision service for a new image and for the same image again (served from the cache).

    python ops/bench/vision_cache.py [--preset vit-tiny] [--size 224] [--images 10]

Starts ``k3 serve vision`` in this process (a real gRPC server on 127.0.0.1, in-process token cache), then for
``--images`` distinct random PNGs sends each one twice through ``Encode`` and times both calls from the
client. Prints one JSON object: median and worst latency of the first (encoded) and second (cache hit) calls,
their ratio, and the service's ``Stats`` (hits, misses, tokens encoded, encoder seconds). A hit still
decodes the image (the content hash is of the pixels), so the ratio is what skipping the encoder saves.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="vit-tiny")
    parser.add_argument("--size", type=int, default=224, help="image side in pixels")
    parser.add_argument("--images", type=int, default=10)
    args = parser.parse_args(argv)

    import grpc
    import numpy as np
    import torch
    from PIL import Image

    from k3.protos.v1 import vision_pb2, vision_pb2_grpc
    from k3.services.common.config import ServerConfig
    from k3.services.common.server import start_server
    from k3.services.vision.config import EncoderSourceConfig, VisionServiceConfig
    from k3.services.vision.service import build

    torch.set_num_threads(1)
    config = VisionServiceConfig(server=ServerConfig(port=0, metrics=False, tracing=False),
                                 encoder=EncoderSourceConfig(preset=args.preset))
    handle = start_server(build(config), config.server)
    rng = np.random.default_rng(0)
    first, second = [], []
    try:
        with grpc.insecure_channel(handle.address) as channel:
            stub = vision_pb2_grpc.VisionStub(channel)
            for _ in range(args.images):
                buffer = io.BytesIO()
                Image.fromarray(rng.integers(0, 256, (args.size, args.size, 3), dtype=np.uint8)).save(buffer, "PNG")
                request = vision_pb2.EncodeRequest(media=[vision_pb2.Media(image=buffer.getvalue())])
                for times in (first, second):
                    started = time.perf_counter()
                    stub.Encode(request, timeout=600)
                    times.append(time.perf_counter() - started)
            stats = stub.Stats(vision_pb2.VisionStatsRequest(), timeout=60)
    finally:
        handle.stop(grace=0)
    print(json.dumps({
        "preset": args.preset, "image": f"{args.size}x{args.size} PNG", "images": args.images,
        "first_ms_median": round(1000 * statistics.median(first), 2), "first_ms_max": round(1000 * max(first), 2),
        "hit_ms_median": round(1000 * statistics.median(second), 2), "hit_ms_max": round(1000 * max(second), 2),
        "first_over_hit": round(statistics.median(first) / statistics.median(second), 2),
        "stats": {"cache_hits": stats.cache_hits, "cache_misses": stats.cache_misses,
                  "tokens_encoded": stats.tokens_encoded, "encode_seconds": round(stats.encode_seconds, 3)},
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
