"""Media decoding and patchifying throughput on one core: images/s, audio seconds/s, video frames/s.

    python bench/media.py [--seconds 3]       # from a checkout built in place, PYTHONPATH=.

Each format's file is made once by Debian's encoders (cjpeg, cwebp, ffmpeg; a format whose program
or decoder is missing is skipped), then decoded into tokens on one thread, over and over, through
the same library functions a step calls. Inputs are what a data loader meets: a 640 x 480 photo-like
image cut into 16-pixel patches with at most 256 tokens (so shrunk to fit), 10 s of 44.1 kHz stereo
resampled to 16 kHz mono in 400-sample chunks, and a 2 s 320 x 240 clip at 25 fps cut into 2-frame
tubelets. Prints one JSON line per format.
"""
import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
import zlib

import numpy as np

import uform
from uform import _testing


def photo(height=480, width=640, seed=0):
    """Smooth shapes with texture, so the codecs compress it as they would a photograph."""
    generator = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    channels = [127 + 120 * np.sin(x / 37 + c) * np.cos(y / 53 - c) for c in range(3)]
    noise = generator.normal(0, 8, (height, width, 3))
    return np.clip(np.stack(channels, axis=-1) + noise, 0, 255).astype(np.uint8)


def png(pixels):
    def chunk(kind, data):
        return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")

    raw = b"".join(b"\x00" + row.tobytes() for row in pixels)
    header = pixels.shape[1].to_bytes(4, "big") + pixels.shape[0].to_bytes(4, "big") + bytes([8, 2, 0, 0, 0])
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b"")


def files(folder):
    """{name: (kind, bytes, units per item)}: units are images, seconds of audio, or frames."""
    pixels = photo()
    made = {"png": ("image", png(pixels), 1)}
    source = os.path.join(folder, "photo.png")
    with open(source, "wb") as file:
        file.write(made["png"][1])
    ppm = b"P6\n640 480\n255\n" + pixels.tobytes()
    if shutil.which("cjpeg"):
        made["jpeg"] = ("image", subprocess.run(["cjpeg", "-quality", "85"], input=ppm, capture_output=True,
                                                check=True).stdout, 1)
    if shutil.which("cwebp"):
        target = os.path.join(folder, "photo.webp")
        subprocess.run(["cwebp", "-quiet", "-q", "80", source, "-o", target], check=True)
        made["webp"] = ("image", open(target, "rb").read(), 1)
    if shutil.which("ffmpeg"):
        sound = ["-f", "lavfi", "-i", "sine=frequency=440:sample_rate=44100:duration=10", "-ac", "2"]
        clip = ["-f", "lavfi", "-i", "testsrc2=size=320x240:rate=25:duration=2"]
        for name, arguments, suffix, kind, units in [
            ("wav", sound, "wav", "audio", 10), ("flac", sound, "flac", "audio", 10),
            ("mp3", sound + ["-b:a", "128k"], "mp3", "audio", 10),
            ("ogg-opus", sound + ["-c:a", "libopus", "-b:a", "96k"], "ogg", "audio", 10),
            ("mp4-h264", clip + ["-c:v", "libx264", "-pix_fmt", "yuv420p"], "mp4", "video", 50),
            ("webm-vp9", clip + ["-c:v", "libvpx-vp9", "-b:v", "500k"], "webm", "video", 50),
            ("mkv-av1", clip + ["-c:v", "libaom-av1", "-cpu-used", "8", "-b:v", "500k"], "mkv", "video", 50),
        ]:
            target = os.path.join(folder, f"{name}.{suffix}")
            subprocess.run(["ffmpeg", "-v", "error", "-y", *arguments, target], check=True)
            made[name] = (kind, open(target, "rb").read(), units)
    return made


def decode(kind, data):
    if kind == "image":
        return _testing.image_patches(data, patch_side=16, channels=3, max_tokens=256)
    if kind == "audio":
        return _testing.audio_chunks(data, sample_rate=16000, chunk_samples=400, max_tokens=400)
    # 15 x 20 patches a frame, 25 tubelets: every frame of the clip is decoded and kept
    return _testing.video_tubelets(data, patch_side=16, tube_frames=2, frame_stride=1, channels=3, max_tokens=7500)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="time spent on each format")
    arguments = parser.parse_args()
    formats = uform.capabilities()
    with tempfile.TemporaryDirectory() as folder:
        made = files(folder)
    for name, (kind, data, units) in made.items():
        if name.split("-")[0] not in formats:
            print(json.dumps(dict(format=name, skipped="not decoded by this build")))
            continue
        data = np.frombuffer(data, np.uint8)
        tokens, grid = decode(kind, data)  # warm-up, and the shape the line reports
        count, started = 0, time.perf_counter()
        while time.perf_counter() - started < arguments.seconds:
            decode(kind, data)
            count += 1
        elapsed = time.perf_counter() - started
        unit = {"image": "images", "audio": "audio_seconds", "video": "frames"}[kind]
        print(json.dumps({"format": name, "bytes": len(data), "tokens": len(tokens), "grid": grid,
                          f"{unit}_per_second": round(count * units / elapsed, 1),
                          "ms_per_item": round(1000 * elapsed / count, 2)}))


if __name__ == "__main__":
    main()
