"""The systems a user would pick instead of the pod, doing the pod's job in their own idiom.

Each peer is a program of its own (``python -m sandbox_lanes_bench.peers.<peer>``), run by
``bench/peers_figure.py`` against the same broker as the pod. They need the ``[bench]`` extra
(Quix Streams, faust-streaming, confluent-kafka); the product never imports them.
"""
