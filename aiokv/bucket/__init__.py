# SPDX-License-Identifier: Apache-2.0
"""The bucket tier: blocks uploaded to an S3-compatible bucket so that other
engines (other nodes) load them instead of recomputing (docs/sharing.md).

    naming.py   object names (the URL's syntax is aiokv/config.py's)
    client.py   the S3 client (obstore): write-once PUT, GET, HEAD, with deadlines, behind
                a circuit breaker (aiokv/util/breaker.py): a failing server is skipped for a while
    uploader.py write-behind uploads from a worker's event loop (bounded, lossy)
    prober.py   asynchronous, cached existence probes for the scheduler thread
    loader.py   loads from the bucket into a staging buffer, verified like a local read

Nothing here imports vLLM.
"""
