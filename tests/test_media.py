"""Media decoding inside the library: images, audio and video to patches, chunks and tubelets.

Every file is made here: PNGs by Python's zlib, JPEG and WebP by Debian's cjpeg and cwebp, audio by
Python's wave and the ffmpeg program, video by ffmpeg. Decoded values are compared with independent
decodes (numpy for PNG and WAV, djpeg, dwebp and ffmpeg for the rest) pushed through a float64 numpy
reference of the resize and the patch layout. A test that needs a program skips where it is missing;
CI installs them all (.ci/run).
"""
import concurrent.futures
import ctypes
import os
import re
import shutil
import struct
import subprocess
import zlib

import numpy as np
import pytest

import uform
from uform import _testing

FORMATS = uform.capabilities()


def needs(*programs):
    missing = [program for program in programs if not shutil.which(program)]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)} (Debian: see .ci/run)")


def needs_format(*names):
    missing = [name for name in names if name not in FORMATS]
    return pytest.mark.skipif(bool(missing), reason=f"this build does not decode {', '.join(missing)}")


# ---------------------------------------------------------------------------------------------- #
#  References                                                                                     #
# ---------------------------------------------------------------------------------------------- #


def triangle_weights(inputs, outputs):
    """Pillow's BILINEAR coefficients from `inputs` to `outputs` samples, as a dense (outputs, inputs) matrix."""
    scale = inputs / outputs
    filter_scale = max(scale, 1.0)
    support = filter_scale
    matrix = np.zeros((outputs, inputs))
    for out in range(outputs):
        center = (out + 0.5) * scale
        start = max(int(center - support + 0.5), 0)
        end = min(int(center + support + 0.5), inputs)
        taps = np.arange(start, end)
        weights = np.maximum(0.0, 1.0 - np.abs((taps - center + 0.5) / filter_scale))
        matrix[out, start:end] = weights / weights.sum()
    return matrix


def fit(height, width, side, max_tokens):
    rows = max(1, (height + side // 2) // side)
    columns = max(1, (width + side // 2) // side)
    if rows * columns <= max_tokens:
        return rows, columns, False
    factor = np.sqrt(max_tokens / (rows * columns))
    fit_rows, fit_columns = max(1, int(np.floor(rows * factor))), max(1, int(np.floor(columns * factor)))
    if fit_rows * fit_columns > max_tokens:
        if fit_rows >= fit_columns:
            fit_rows = max_tokens // fit_columns
        else:
            fit_columns = max_tokens // fit_rows
    return fit_rows, fit_columns, True


def resize(pixels, rows, columns, side):
    """(height, width, channels) uint8 -> (rows * side, columns * side, channels) float64, Pillow's BILINEAR."""
    pixels = pixels.astype(np.float64)
    vertical = triangle_weights(pixels.shape[0], rows * side)
    horizontal = triangle_weights(pixels.shape[1], columns * side)
    return np.einsum("yi,ijc,xj->yxc", vertical, pixels, horizontal)


def patchify(picture, side):
    """(rows * side, columns * side, channels) -> (rows * columns, side, side, channels), raster order."""
    height, width, channels = picture.shape
    rows, columns = height // side, width // side
    return picture.reshape(rows, side, columns, side, channels).transpose(0, 2, 1, 3, 4).reshape(-1, side, side, channels)


def normalize(values):
    return (values / 255.0 - 0.5) / 0.5


def luma(rgb):
    """Pillow's "L": ITU-R 601 in 16-bit fixed point, rounded."""
    if rgb.shape[2] == 1:
        return rgb
    rgb = rgb.astype(np.uint32)
    return ((rgb[..., 0] * 19595 + rgb[..., 1] * 38470 + rgb[..., 2] * 7471 + 0x8000) >> 16).astype(np.uint8)[..., None]


def expected_patches(rgba, side, channels, max_tokens=256):
    """The reference for `uform_image_patches` given the decoded RGBA (or RGB) pixels."""
    if channels == 1:
        pixels = luma(rgba)
    elif channels == 3:
        pixels = rgba[..., :3]
    else:
        pixels = rgba if rgba.shape[2] == 4 else np.concatenate([rgba, np.full(rgba.shape[:2] + (1,), 255, np.uint8)], 2)
    rows, columns, truncated = fit(rgba.shape[0], rgba.shape[1], side, max_tokens)
    return normalize(patchify(resize(pixels, rows, columns, side), side)), (rows, columns, truncated)


def picture(height, width, channels=3, seed=0):
    """A smooth picture with some texture: gradients, a disc and noise."""
    generator = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    layers = [255 * x / max(width - 1, 1), 255 * y / max(height - 1, 1),
              255 * (((y - height / 2) ** 2 + (x - width / 2) ** 2) < (min(height, width) / 3) ** 2),
              np.full((height, width), 200.0)]
    stack = np.stack(layers[:channels], axis=-1) + generator.normal(0, 12, (height, width, channels))
    return np.clip(stack, 0, 255).astype(np.uint8)


# ---------------------------------------------------------------------------------------------- #
#  Files                                                                                          #
# ---------------------------------------------------------------------------------------------- #


def png_chunk(kind, data):
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_bytes(pixels, depth=8, color=None, palette=None, transparency=None, width=None, height=None):
    """A PNG of `pixels` (height, width, channels) written with zlib; width/height override the IHDR's."""
    if color is None:
        color = {1: 0, 2: 4, 3: 2, 4: 6}[pixels.shape[2]]
    rows = pixels.astype(">u2" if depth == 16 else np.uint8).reshape(pixels.shape[0], -1)
    raw = b"".join(b"\x00" + row.tobytes() for row in rows)
    header = struct.pack(">IIBBBBB", width if width is not None else pixels.shape[1],
                         height if height is not None else pixels.shape[0], depth, color, 0, 0, 0)
    body = png_chunk(b"IHDR", header)
    if palette is not None:
        body += png_chunk(b"PLTE", palette.astype(np.uint8).tobytes())
    if transparency is not None:
        body += png_chunk(b"tRNS", transparency)
    body += png_chunk(b"IDAT", zlib.compress(raw)) + png_chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + body


def ppm_bytes(pixels):
    kind = b"P5" if pixels.shape[2] == 1 else b"P6"
    return kind + b"\n%d %d\n255\n" % (pixels.shape[1], pixels.shape[0]) + pixels.tobytes()


def read_ppm(data):
    """Pixels of a binary PGM or PPM (djpeg's and dwebp's output)."""
    fields, at = [], 0
    while len(fields) < 4:
        while data[at:at + 1].isspace():
            at += 1
        if data[at:at + 1] == b"#":
            at = data.index(b"\n", at)
            continue
        end = at
        while not data[end:end + 1].isspace():
            end += 1
        fields.append(data[at:end])
        at = end
    at += 1
    channels = 1 if fields[0] == b"P5" else 3
    width, height = int(fields[1]), int(fields[2])
    return np.frombuffer(data[at:at + width * height * channels], np.uint8).reshape(height, width, channels)


def run(arguments, data=None):
    return subprocess.run(arguments, input=data, capture_output=True, check=True).stdout


def jpeg_bytes(pixels, quality=90, tmp_path=None):
    return run(["cjpeg", "-quality", str(quality)], ppm_bytes(pixels))


def djpeg(data):
    return read_ppm(run(["djpeg", "-pnm"], data))


def webp_bytes(pixels, tmp_path, lossless=False):
    source, target = tmp_path / "source.png", tmp_path / "image.webp"
    source.write_bytes(png_bytes(pixels))
    run(["cwebp", "-quiet"] + (["-lossless"] if lossless else ["-q", "80"]) + [str(source), "-o", str(target)])
    return target.read_bytes()


def dwebp(data, tmp_path):
    source, target = tmp_path / "decode.webp", tmp_path / "decode.ppm"
    source.write_bytes(data)
    run(["dwebp", "-quiet", str(source), "-ppm", "-o", str(target)])
    return read_ppm(target.read_bytes())


def decoded(data, **arguments):
    patches, grid = _testing.image_patches(np.frombuffer(data, np.uint8), **arguments)
    return patches, grid


def check_image(data, reference_rgba, side, channels, max_tokens=256, tolerance=1e-5):
    patches, grid = decoded(data, patch_side=side, channels=channels, max_tokens=max_tokens)
    want, (rows, columns, truncated) = expected_patches(reference_rgba, side, channels, max_tokens)
    assert (grid["frames"], grid["rows"], grid["columns"], grid["truncated"]) == (1, rows, columns, truncated)
    assert patches.shape == want.shape
    np.testing.assert_allclose(patches, want, atol=tolerance)
    return patches


# ---------------------------------------------------------------------------------------------- #
#  Capabilities                                                                                   #
# ---------------------------------------------------------------------------------------------- #


def test_formats_listed_once():
    """The library's list and `uform.capabilities()` name the same formats."""
    listed = set(filter(None, _testing.media_formats().split(",")))
    media = FORMATS - {"ram", "vram", "mesh"}
    assert listed == media


@pytest.mark.skipif(not shutil.which("pkg-config") or not shutil.which("cc"), reason="needs pkg-config and cc")
def test_formats_follow_pkg_config():
    """A library that pkg-config finds is compiled in: a machine with the packages decodes their formats."""
    families = {"jpeg": ["libjpeg"], "png": ["libpng"], "webp": ["libwebp"],
                "wav": ["libavformat", "libavcodec", "libavutil", "libswresample", "libswscale"]}
    for name, packages in families.items():
        found = subprocess.run(["pkg-config", "--exists", *packages]).returncode == 0
        assert (name in FORMATS) == found, name


@pytest.mark.skipif(not shutil.which("cc"), reason="needs a C compiler")
def test_formats_not_compiled_in_are_refused_by_name(tmp_path):
    """The media sources built without any decoder: each format is refused naming the package that adds it."""
    root = os.path.join(os.path.dirname(__file__), "..", "libuform")
    program = tmp_path / "bare.c"
    program.write_text(r'''
#include <stdio.h>
#include "media/media.h"
int main(int count, char** names) {
    FILE* file = fopen(names[1], "rb");
    static unsigned char bytes[1 << 20];
    size_t length = fread(bytes, 1, sizeof(bytes), file);
    fclose(file);
    static float out[1 << 20];
    uform_media_grid_t grid;
    char const* error = NULL;
    uform_status_t status = names[2][0] == 'i' ? uform_image_patches(bytes, length, 16, 3, 16, out, &grid, "item", &error)
                            : names[2][0] == 'a' ? uform_audio_chunks(bytes, length, 16000, 400, 16, out, &grid, "item", &error)
                            : uform_video_tubelets(bytes, length, 16, 2, 1, 3, 16, out, &grid, "item", &error);
    printf("%d|%s|%s\n", (int)status, error ? error : "", uform_media_formats());
    return count < 3;
}
''')
    sources = [os.path.join(root, "src", "errors.c")] + sorted(
        os.path.join(root, "src", "media", name) for name in os.listdir(os.path.join(root, "src", "media"))
        if name.endswith(".c"))
    binary = tmp_path / "bare"
    subprocess.run(["cc", "-std=c99", "-D_POSIX_C_SOURCE=200809L", "-Wall", "-Werror", "-pedantic",
                    f"-I{root}/include", f"-I{root}/src", str(program), *sources, "-o", str(binary), "-pthread", "-lm"],
                   check=True)
    cases = {
        "image": (png_bytes(picture(8, 8)), "PNG images need a build with libpng (Debian: libpng-dev)"),
        "audio": (b"RIFF\x24\x00\x00\x00WAVEfmt ", "WAV audio need a build with FFmpeg's"),
        "video": (b"\x00\x00\x00\x18ftypisom" + bytes(16), "MP4 video need a build with FFmpeg's"),
    }
    for kind, (data, message) in cases.items():
        (tmp_path / "item").write_bytes(data)
        status, error, formats = run([str(binary), str(tmp_path / "item"), kind]).decode().strip().split("|")
        assert int(status) == 4, error  # uform_status_unsupported_k
        assert error.startswith("item: " + message), error
        assert formats == ""


# ---------------------------------------------------------------------------------------------- #
#  Images                                                                                         #
# ---------------------------------------------------------------------------------------------- #


@needs_format("png")
@pytest.mark.parametrize("channels", [1, 3, 4])
@pytest.mark.parametrize("shape", [(64, 48), (37, 91), (16, 16), (5, 300), (200, 3)])
def test_png_patches_match_numpy(shape, channels):
    pixels = picture(*shape, channels=4, seed=shape[0])
    check_image(png_bytes(pixels), pixels, side=8, channels=channels)


@needs_format("png")
def test_png_color_types_and_depths():
    """Gray, gray + alpha, palette with transparency, 16-bit, and 1-bit gray all become the same RGBA."""
    rgba = picture(20, 30, channels=4)
    gray = rgba[..., :1]
    gray_rgba = np.concatenate([gray, gray, gray, np.full_like(gray, 255)], axis=2)
    check_image(png_bytes(gray), gray_rgba, side=4, channels=4)
    check_image(png_bytes(gray), gray, side=4, channels=1)  # luma of gray is the gray itself
    alpha = np.concatenate([gray, rgba[..., 3:]], axis=2)
    check_image(png_bytes(alpha), np.concatenate([gray, gray, gray, rgba[..., 3:]], axis=2), side=4, channels=4)
    # 16 bits: scaled to 8 with rounding
    wide = np.minimum(rgba.astype(np.uint32) * 257 + 100, 65535)
    check_image(png_bytes(wide, depth=16), np.round(wide * 255 / 65535).astype(np.uint8), side=4, channels=4)
    # a palette whose entries 0 and 1 are half and fully transparent
    palette = np.array([[255, 0, 0], [0, 255, 0], [0, 0, 255], [9, 99, 199]])
    indices = (np.arange(20 * 30).reshape(20, 30, 1) * 7 % 4).astype(np.uint8)
    alphas = np.array([128, 0, 255, 255], np.uint8)
    want = np.concatenate([palette[indices[..., 0]], alphas[indices]], axis=2).astype(np.uint8)
    check_image(png_bytes(indices, color=3, palette=palette, transparency=alphas[:2].tobytes()), want, 4, 4)
    # 1-bit gray, packed 8 pixels a byte
    bits = (np.arange(16 * 16).reshape(16, 16) // 3 % 2).astype(np.uint8)
    packed = np.packbits(bits, axis=1).reshape(16, 2, 1)
    ones = bits[..., None] * 255
    data = png_bytes(packed, depth=1, color=0, width=16)
    check_image(data, np.concatenate([ones, ones, ones, np.full_like(ones, 255)], 2).astype(np.uint8), 4, 4)


@needs_format("png")
def test_rgb_ignores_alpha():
    """RGB of an RGBA file keeps the colours as stored, whatever their alpha."""
    rgba = picture(16, 16, channels=4)
    rgba[..., 3] = 0
    patches, _ = decoded(png_bytes(rgba), patch_side=16, channels=3)
    np.testing.assert_allclose(patches[0], normalize(rgba[..., :3].astype(np.float64)), atol=1e-5)


@needs_format("jpeg")
@needs("cjpeg", "djpeg")
@pytest.mark.parametrize("channels", [1, 3, 4])
@pytest.mark.parametrize("source_channels", [1, 3])
def test_jpeg_matches_djpeg(source_channels, channels):
    pixels = picture(70, 45, channels=source_channels, seed=3)
    data = jpeg_bytes(pixels)
    reference = djpeg(data)
    if reference.shape[2] == 1:
        reference = np.repeat(reference, 3, axis=2)
    check_image(data, reference, side=8, channels=channels, tolerance=1e-4)


@needs_format("jpeg")
@needs("cjpeg", "djpeg")
def test_progressive_jpeg():
    pixels = picture(64, 64, seed=4)
    data = run(["cjpeg", "-progressive", "-quality", "80"], ppm_bytes(pixels))
    check_image(data, djpeg(data), side=16, channels=3, tolerance=1e-4)


@needs_format("jpeg")
@needs("cjpeg", "djpeg")
def test_jpeg_of_many_scans(tmp_path):
    """Each progressive scan is a pass over the picture, so more than 100 are refused; 99, the most cjpeg
    writes, are read as djpeg reads them."""
    script = ["0,1,2: 0 0 0 0;"]
    for component, last in ((0, 48), (1, 24), (2, 23)):
        script += [f"{component}: {k} {k} 0 0;" for k in range(1, last + 1)] + [f"{component}: {last + 1} 63 0 0;"]
    assert len(script) == 99
    (tmp_path / "scans").write_text("\n".join(script))
    data = run(["cjpeg", "-scans", str(tmp_path / "scans")], ppm_bytes(picture(32, 32)))
    check_image(data, djpeg(data), side=8, channels=3, tolerance=1e-4)


@needs_format("webp")
@needs("cwebp", "dwebp")
@pytest.mark.parametrize("lossless", [True, False])
@pytest.mark.parametrize("channels", [1, 3, 4])
def test_webp_matches(lossless, channels, tmp_path):
    pixels = picture(33, 50, channels=4 if lossless else 3, seed=5)
    data = webp_bytes(pixels, tmp_path, lossless=lossless)
    # dwebp's PPM drops alpha; a lossless file's pixels are the source's
    reference = pixels if lossless else dwebp(data, tmp_path)
    check_image(data, reference, side=8, channels=channels, tolerance=1e-4)


@needs_format("png")
@pytest.mark.parametrize("max_tokens, shape", [(6, (64, 64)), (5, (64, 256)), (3, (16, 256)), (1, (100, 100)),
                                               (7, (256, 32))])
def test_images_shrink_to_fit(max_tokens, shape):
    """More patches than max_tokens: both sides scaled by one factor, truncated set, never over the room."""
    pixels = picture(*shape, channels=3)
    patches = check_image(png_bytes(pixels), pixels, side=16, channels=3, max_tokens=max_tokens)
    assert 1 <= len(patches) <= max_tokens


@needs_format("png")
def test_upscales_small_images():
    """An image smaller than a patch still makes one whole patch; a 1-pixel image fills it flat."""
    pixels = np.array([[[10, 200, 30]]], np.uint8)
    patches, grid = decoded(png_bytes(pixels), patch_side=4, channels=3)
    assert (grid["rows"], grid["columns"]) == (1, 1)
    np.testing.assert_allclose(patches[0], np.broadcast_to(normalize(pixels[0, 0].astype(np.float64)), (4, 4, 3)),
                               atol=1e-6)


@needs_format("png", "jpeg")
def test_threads_decode_alike():
    """Decoding on several threads at once gives each image what decoding it alone gives."""
    items = [png_bytes(picture(40 + i, 60 - i, seed=i)) for i in range(8)]
    if shutil.which("cjpeg"):
        items += [jpeg_bytes(picture(50, 30 + i, seed=i)) for i in range(8)]
    alone = [decoded(item, patch_side=8)[0] for item in items]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda item: decoded(item, patch_side=8)[0], items * 4))
    for i, patches in enumerate(together):
        np.testing.assert_array_equal(patches, alone[i % len(items)])


# ---------------------------------------------------------------------------------------------- #
#  Bad images                                                                                     #
# ---------------------------------------------------------------------------------------------- #


def refused(data, error=uform.InvalidArgument, match=None, **arguments):
    with pytest.raises(error, match=match):
        decoded(data, **arguments)


def test_image_arguments_refused():
    data = png_bytes(picture(8, 8))
    refused(data, channels=2, match=r"batch.contents\[0\]: channels = 2")
    refused(data, patch_side=0, match="patch_side = 0")
    refused(data, max_tokens=0, match="max_tokens = 0")
    refused(b"", match="empty image")


def test_other_kinds_refused_by_name():
    refused(b"RIFF\x24\x00\x00\x00WAVEfmt " + bytes(20), match=r"declared an image, but the bytes are audio \(wav\)")
    refused(b"\x1a\x45\xdf\xa3\x9f\x42\x86\x81\x01\x42\x82\x84webm", match=r"are video \(webm\)")
    refused(b"GIF89a" + bytes(20), match="match no format")
    refused(b"\xff\xd8", match="match no format")  # too short to be a JPEG


@needs_format("png")
def test_bad_pngs_refused():
    data = png_bytes(picture(30, 30))
    for cut in (9, 33, len(data) // 2, len(data) - 13, len(data) - 1):
        refused(data[:cut], match="PNG")
    corrupt = bytearray(data)
    corrupt[40] ^= 0xFF  # inside IDAT: its CRC no longer matches
    refused(bytes(corrupt), match="not a readable PNG")
    refused(png_bytes(picture(4, 4), width=0), match="PNG")
    refused(png_bytes(picture(4, 4), height=0), match="PNG")


def test_a_path_given_for_a_files_bytes_is_told_so():
    refused(b"photos/cat number 7.png", match=r"match no format uform reads \(.*\); they read like a file's path, "
                                               r"and an item's contents are the file's bytes")
    with pytest.raises(uform.InvalidArgument, match="match no format") as caught:
        decoded(b"not a picture at all")
    assert "path" not in str(caught.value)  # text, but no path: no hint


@needs_format("png")
def test_png_bomb_refused_before_allocating():
    """IHDRs declaring huge pictures over a few bytes of data: refused from the header."""
    for width, height in ((30000, 10), (10, 30000), (8000, 8000), (100000, 100000)):
        refused(png_bytes(picture(4, 4), width=width, height=height),
                match=rf"PNG image of {width} x {height} pixels is over the limit of 16384 pixels a side")


@needs_format("jpeg")
@needs("cjpeg")
def test_bad_jpegs_refused():
    data = jpeg_bytes(picture(64, 64))
    for cut in (3, 20, len(data) // 2, len(data) - 2):
        refused(data[:cut], match="JPEG")
    corrupt = bytearray(data)
    for at in range(len(data) // 2, len(data) // 2 + 40):
        corrupt[at] = 0xFF  # markers where entropy-coded data should be
    refused(bytes(corrupt), match="not a readable JPEG")


def jpeg_with_size(data, width, height):
    """The file with its SOF's declared size replaced."""
    data = bytearray(data)
    at = 2
    while data[at + 1] not in (0xC0, 0xC1, 0xC2):
        at += 2 + struct.unpack(">H", data[at + 2:at + 4])[0]
    data[at + 5:at + 9] = struct.pack(">HH", height, width)
    return bytes(data)


@needs_format("jpeg")
@needs("cjpeg")
def test_jpeg_bomb_and_empty_refused():
    data = jpeg_bytes(picture(16, 16))
    refused(jpeg_with_size(data, 60000, 60000), match="limit")
    refused(jpeg_with_size(data, 8000, 8000), match="limit")
    refused(jpeg_with_size(data, 0, 16), match="JPEG")


def webp_lossless_header(width, height):
    """A lossless WebP whose header declares `width x height` and whose pixels are missing."""
    bits = (width - 1) | (height - 1) << 14
    payload = b"\x2f" + struct.pack("<I", bits) + bytes(8)
    chunk = b"VP8L" + struct.pack("<I", len(payload)) + payload
    return b"RIFF" + struct.pack("<I", 4 + len(chunk)) + b"WEBP" + chunk


@needs_format("webp")
@needs("cwebp")
def test_bad_webps_refused(tmp_path):
    data = webp_bytes(picture(40, 40), tmp_path)
    for cut in (12, 30, len(data) // 2, len(data) - 1):
        refused(data[:cut], match="WebP")
    refused(webp_lossless_header(16000, 16000), match="limit")


# ---------------------------------------------------------------------------------------------- #
#  Audio                                                                                          #
# ---------------------------------------------------------------------------------------------- #


def wav_bytes(samples, rate, width=2):
    """A PCM WAV of `samples` (frames, channels) in [-1, 1] at `width` bytes a sample, by Python's wave."""
    import io
    import wave

    if width == 1:
        data = np.round(samples * 127 + 128).astype(np.uint8).tobytes()
    else:
        scale = 2 ** (8 * width - 1) - 1
        ints = np.round(samples * scale).astype(np.int64)
        data = b"".join(int(value).to_bytes(width, "little", signed=True) for value in ints.reshape(-1)) \
            if width == 3 else ints.astype(f"<i{width}").tobytes()
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as file:
        file.setnchannels(samples.shape[1])
        file.setsampwidth(width)
        file.setframerate(rate)
        file.writeframes(data)
    return buffer.getvalue()


def wav_raw(format_tag, channels, rate, bits, data):
    """A WAV with any format tag and channel count, written by hand."""
    block = channels * bits // 8
    fmt = struct.pack("<HHIIHH", format_tag, channels, rate, rate * block, block, bits)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def pcm_values(data, width):
    """What a PCM WAV's integers stand for, as libavcodec and libswresample read them."""
    if width == 1:
        return (np.frombuffer(data, np.uint8).astype(np.float64) - 128) / 128
    if width == 3:  # 24-bit: sign-extended into 32 (libavcodec's s24le decoder shifts them up the same way)
        triples = np.frombuffer(data, np.uint8).reshape(-1, 3).astype(np.int32)
        values = (triples[:, 0] << 8 | triples[:, 1] << 16 | triples[:, 2] << 24) >> 8
        return values.astype(np.float64) / 2 ** 23
    return np.frombuffer(data, f"<i{width}").astype(np.float64) / 2 ** (8 * width - 1)


def tone(seconds, rate, channels=1, frequency=440.0):
    t = np.arange(int(seconds * rate)) / rate
    waves = [0.5 * np.sin(2 * np.pi * frequency * (c + 1) * t) for c in range(channels)]
    return np.stack(waves, axis=1)


def chunked(samples, chunk_samples):
    count = -(-len(samples) // chunk_samples)
    padded = np.zeros(count * chunk_samples)
    padded[:len(samples)] = samples
    return padded.reshape(count, chunk_samples)


def audio(data, **arguments):
    return _testing.audio_chunks(np.frombuffer(data, np.uint8), **arguments)


def ffmpeg_mono(data, rate, tmp_path, suffix):
    """The ffmpeg program's decode of a file: channels averaged, resampled by the same filter uform asks for."""
    source = tmp_path / f"reference.{suffix}"
    source.write_bytes(data)
    channels = int(run(["ffprobe", "-v", "error", "-select_streams", "a:0", "-show_entries", "stream=channels",
                        "-of", "csv=p=0", str(source)]).decode().strip())
    mix = "+".join(f"{1 / channels!r}*c{i}" for i in range(channels))
    graph = (f"pan=mono|c0={mix},aresample={rate}:filter_size=32:phase_shift=10:linear_interp=1:cutoff=0.97:"
             "filter_type=kaiser:kaiser_beta=9")
    raw = run(["ffmpeg", "-v", "error", "-i", str(source), "-af", graph, "-f", "f32le", "-"])
    return np.frombuffer(raw, np.float32).astype(np.float64)


def encode(data, tmp_path, suffix, *arguments):
    """`data` (a WAV) re-encoded by the ffmpeg program into a file of `suffix`."""
    source, target = tmp_path / "source.wav", tmp_path / f"encoded.{suffix}"
    source.write_bytes(data)
    run(["ffmpeg", "-v", "error", "-y", "-i", str(source), *arguments, str(target)])
    return target.read_bytes()


@needs_format("wav")
@pytest.mark.parametrize("width", [1, 2, 3, 4])
@pytest.mark.parametrize("channels", [1, 2, 5])
def test_wav_is_the_mean_of_its_channels(width, channels):
    data = wav_bytes(tone(0.3, 16000, channels), 16000, width)
    header = data.index(b"data") + 8
    want = pcm_values(data[header:], width).reshape(-1, channels).mean(axis=1)
    chunks, grid = audio(data, sample_rate=16000, chunk_samples=400)
    assert grid == dict(frames=12, rows=1, columns=1, truncated=False)
    np.testing.assert_allclose(chunks, chunked(want, 400), atol=1e-6)


@needs_format("wav")
def test_wav_resampled_to_the_rate():
    """44.1 kHz to 16 kHz: the same tone, sampled at the new rate, away from the filter's edges."""
    data = wav_bytes(tone(0.5, 44100), 44100)
    chunks, grid = audio(data, sample_rate=16000, chunk_samples=320)
    samples = chunks.reshape(-1)
    assert grid["frames"] == 25 and not grid["truncated"]
    want = tone(0.5, 16000)[:, 0]
    np.testing.assert_allclose(samples[100:7900], want[100:7900], atol=2e-3)


@needs_format("wav")
def test_audio_cut_to_max_tokens():
    data = wav_bytes(tone(1.0, 16000, 2), 16000)
    whole, grid = audio(data, sample_rate=16000, chunk_samples=400)
    assert grid["frames"] == 40 and not grid["truncated"]
    cut, grid = audio(data, sample_rate=16000, chunk_samples=400, max_tokens=7)
    assert grid == dict(frames=7, rows=1, columns=1, truncated=True)
    np.testing.assert_array_equal(cut, whole[:7])
    exact, grid = audio(data, sample_rate=16000, chunk_samples=400, max_tokens=40)
    assert grid["frames"] == 40 and not grid["truncated"]


@needs_format("wav")
def test_audio_below_a_thousand_samples_a_second_is_refused_before_resampling():
    """800 samples at 1 Hz would resample to 12.8 M at 16 kHz: hundreds of MB for 1.6 kB of file."""
    for rate in (1, 999):
        with pytest.raises(uform.InvalidArgument, match=rf"audio at {rate} samples a second; uform reads 1000 to 768000"):
            audio(wav_bytes(tone(800 / rate, rate)[:800], rate), sample_rate=16000, chunk_samples=400)
    chunks, _ = audio(wav_bytes(tone(0.1, 1000), 1000), sample_rate=16000, chunk_samples=400)
    assert chunks.shape == (4, 400)


@needs_format("wav", "flac", "mp3", "ogg")
@needs("ffmpeg", "ffprobe")
@pytest.mark.parametrize("suffix, arguments", [
    ("wav", []), ("flac", []), ("mp3", ["-b:a", "96k"]), ("ogg", ["-c:a", "libopus", "-b:a", "64k"]),
    ("oga", ["-c:a", "libvorbis", "-f", "ogg"]),
])
def test_encoded_audio_matches_ffmpeg(suffix, arguments, tmp_path):
    data = encode(wav_bytes(tone(0.8, 22050, 2), 22050), tmp_path, suffix, *arguments)
    want = ffmpeg_mono(data, 16000, tmp_path, suffix)
    chunks, grid = audio(data, sample_rate=16000, chunk_samples=400)
    assert grid["frames"] == -(-len(want) // 400)
    np.testing.assert_allclose(chunks, chunked(want, 400), atol=1e-4)


@needs_format("wav")
def test_bad_wavs_refused():
    data = wav_bytes(tone(0.2, 8000, 2), 8000)
    with pytest.raises(uform.InvalidArgument, match="truncated"):
        audio(data[:len(data) - 101])
    with pytest.raises(uform.InvalidArgument, match="without a single sample"):
        audio(wav_bytes(np.zeros((0, 1)), 8000))
    with pytest.raises(uform.InvalidArgument, match="40 channels"):
        audio(wav_raw(1, 40, 8000, 16, bytes(40 * 2 * 10)))
    with pytest.raises(uform.InvalidArgument, match="adpcm_ima_wav"):
        audio(wav_raw(0x11, 1, 8000, 4, bytes(256)))
    nan = np.array([0.1, np.nan, 0.2, 0.3] * 50, "<f4").tobytes()
    with pytest.raises(uform.InvalidArgument, match="non-finite"):
        audio(wav_raw(3, 1, 8000, 32, nan))
    with pytest.raises(uform.InvalidArgument, match="unreadable WAV audio"):
        audio(data[:30])
    listed = data[:36] + b"LIST" + struct.pack("<I", 1 << 30) + b"INFO" + data[36:]  # fuzz/RESULTS.md, finding 10
    with pytest.raises(uform.InvalidArgument, match="chunk 'LIST' declares 1073741824 bytes"):
        audio(listed)
    with pytest.raises(uform.InvalidArgument, match=r"declared audio, but the bytes are image \(png\)"):
        audio(png_bytes(picture(4, 4)))
    with pytest.raises(uform.InvalidArgument, match="sample_rate = 0"):
        audio(data, sample_rate=0)


@needs_format("flac", "mp3", "ogg")
@needs("ffmpeg")
@pytest.mark.parametrize("suffix, arguments", [("flac", []), ("mp3", ["-b:a", "96k"]),
                                               ("ogg", ["-c:a", "libvorbis"])])
def test_truncated_or_damaged_audio_refused(suffix, arguments, tmp_path):
    data = encode(wav_bytes(tone(3.0, 22050, 1), 22050), tmp_path, suffix, *arguments)
    with pytest.raises(uform.InvalidArgument):
        audio(data[:len(data) // 2])
    if suffix != "mp3":  # MP3 decoders skip damage to the next frame by design; FLAC and Ogg check CRCs
        damaged = bytearray(data)
        damaged[len(data) // 3:len(data) // 3 + 64] = bytes(64)
        with pytest.raises(uform.InvalidArgument):
            audio(bytes(damaged))
    with pytest.raises(uform.InvalidArgument):
        audio(data[:8])


# ---------------------------------------------------------------------------------------------- #
#  Video                                                                                          #
# ---------------------------------------------------------------------------------------------- #

CODECS = {  # container suffix: the encoder the ffmpeg program makes it with
    "mp4": ["-c:v", "libx264", "-pix_fmt", "yuv420p", "-movflags", "+faststart"],
    "webm": ["-c:v", "libvpx-vp9", "-b:v", "200k"],
    "mkv": ["-c:v", "libaom-av1", "-cpu-used", "8", "-b:v", "200k"],
}


def clip(tmp_path, suffix, frames=7, size="64x48", source="testsrc2", extra=()):
    target = tmp_path / f"clip.{suffix}"
    run(["ffmpeg", "-v", "error", "-y", "-f", "lavfi", "-i", f"{source}=size={size}:rate=10", "-frames:v",
         str(frames), *CODECS.get(suffix, []), *extra, str(target)])
    return target.read_bytes()


def ffmpeg_frames(data, tmp_path, suffix):
    """Every frame as RGB, decoded by the ffmpeg program with the conversion flags uform uses."""
    source = tmp_path / f"frames.{suffix}"
    source.write_bytes(data)
    size = run(["ffprobe", "-v", "error", "-select_streams", "v:0", "-show_entries", "stream=width,height", "-of",
                "csv=p=0", str(source)]).decode().strip().split(",")
    width, height = int(size[0]), int(size[1])
    raw = run(["ffmpeg", "-v", "error", "-i", str(source), "-sws_flags", "bilinear+accurate_rnd+full_chroma_int",
               "-f", "rawvideo", "-pix_fmt", "rgb24", "-"])
    return np.frombuffer(raw, np.uint8).reshape(-1, height, width, 3)


def expected_tubelets(frames, side, tube, stride, channels, max_tokens):
    kept = frames[::stride]
    rows, columns, truncated = fit(frames.shape[1], frames.shape[2], side, max_tokens)
    limit = max_tokens // (rows * columns) * tube
    truncated = truncated or len(kept) > limit
    kept = kept[:limit]
    count = -(-len(kept) // tube)
    kept = np.concatenate([kept, np.repeat(kept[-1:], count * tube - len(kept), axis=0)])
    patches = np.stack([expected_patches(frame, side, channels, max_tokens)[0] for frame in kept])
    # (frames, patches, y, x, c) -> (tubelets, patches, tube, y, x, c) -> tubelets in time, then raster order
    patches = patches.reshape(count, tube, rows * columns, side, side, channels).transpose(0, 2, 1, 3, 4, 5)
    return patches.reshape(count * rows * columns, tube, side, side, channels), (count, rows, columns, truncated)


def video(data, **arguments):
    return _testing.video_tubelets(np.frombuffer(data, np.uint8), **arguments)


@needs_format("mp4", "webm", "mkv")
@needs("ffmpeg", "ffprobe")
@pytest.mark.parametrize("suffix", ["mp4", "webm", "mkv"])
@pytest.mark.parametrize("tube, stride, channels, max_tokens", [(2, 1, 3, 256), (2, 2, 3, 256), (3, 1, 1, 256),
                                                               (2, 1, 4, 30), (1, 3, 3, 5)])
def test_video_matches_ffmpeg(suffix, tube, stride, channels, max_tokens, tmp_path):
    data = clip(tmp_path, suffix)
    frames = ffmpeg_frames(data, tmp_path, suffix)
    assert len(frames) == 7
    want, (count, rows, columns, truncated) = expected_tubelets(frames, 16, tube, stride, channels, max_tokens)
    tubelets, grid = video(data, patch_side=16, tube_frames=tube, frame_stride=stride, channels=channels,
                           max_tokens=max_tokens)
    assert grid == dict(frames=count, rows=rows, columns=columns, truncated=truncated)
    assert tubelets.shape == want.shape
    # the same decoder and converter; the RGB here went through 8 bits, uform's did too, so differences are rounding
    np.testing.assert_allclose(tubelets, want, atol=2 / 127.5)
    assert np.abs(tubelets - want).mean() < 0.2 / 127.5


@needs_format("mp4", "webm")
@needs("ffmpeg")
def test_bad_videos_refused(tmp_path):
    for suffix in ("mp4", "webm"):
        data = clip(tmp_path, suffix, frames=30)
        for cut in (len(data) // 2, len(data) * 9 // 10):
            with pytest.raises(uform.InvalidArgument):
                video(data[:cut])
    with pytest.raises(uform.InvalidArgument, match="mpeg4"):
        video(clip(tmp_path, "mp4", extra=("-c:v", "mpeg4")))
    sound = tmp_path / "sound.mp4"
    run(["ffmpeg", "-v", "error", "-y", "-f", "lavfi", "-i", "sine=duration=0.5", "-c:a", "aac", str(sound)])
    with pytest.raises(uform.InvalidArgument, match="no video stream"):
        video(sound.read_bytes())
    with pytest.raises(uform.InvalidArgument, match=r"declared a video, but the bytes are audio \(wav\)"):
        video(wav_bytes(tone(0.1, 8000), 8000))
    with pytest.raises(uform.InvalidArgument, match="tube_frames = 0"):
        video(clip(tmp_path, "mp4"), tube_frames=0)


@needs_format("mp4")
@needs("ffmpeg")
def test_video_threads_decode_alike(tmp_path):
    items = [clip(tmp_path, "mp4", frames=4 + i) for i in range(4)]
    alone = [video(item)[0] for item in items]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda item: video(item)[0], items * 3))
    for i, tubelets in enumerate(together):
        np.testing.assert_array_equal(tubelets, alone[i % len(items)])


# ---------------------------------------------------------------------------------------------- #
#  uform_media_tokens: one item's tokens as a batch shape reads them                              #
# ---------------------------------------------------------------------------------------------- #


class _Shape(ctypes.Structure):
    """`uform_batch_shape_t`, field for field."""

    _fields_ = [(name, ctypes.c_uint32) for name in (
        "max_rows_per_device", "max_segments_per_device", "max_columns_per_row", "max_bags_per_device",
        "max_choices_per_item", "image_patch_side", "image_channels", "video_patch_side", "video_tube_frames",
        "video_frame_stride", "video_channels", "audio_chunk_samples", "audio_sample_rate")]


def media_tokens_verb():
    """`uform_media_tokens` itself, through ctypes, so arguments Python would never pass reach it."""
    verb = ctypes.CDLL(os.path.join(os.path.dirname(uform.__file__), "libuform.so")).uform_media_tokens
    verb.restype = ctypes.c_int
    verb.argtypes = [ctypes.POINTER(_Shape), ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t,
                     ctypes.POINTER(ctypes.c_float), ctypes.c_size_t, ctypes.POINTER(ctypes.c_uint32),
                     ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_char_p)]
    return verb


def media_tokens_fitted_verb():
    """`uform_media_tokens_fitted`, which also answers whether the item was fitted to the row."""
    verb = ctypes.CDLL(os.path.join(os.path.dirname(uform.__file__), "libuform.so")).uform_media_tokens_fitted
    verb.restype = ctypes.c_int
    verb.argtypes = media_tokens_verb().argtypes[:-1] + [ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_char_p)]
    return verb


def media_tokens_in_c(shape, modality, data, capacity, sizing=False):
    """(status, message, tokens or None, grid, count, width) of one call with room for `capacity` tokens."""
    verb = media_tokens_verb()
    grid, count, width, message = (ctypes.c_uint32 * 3)(), ctypes.c_size_t(7), ctypes.c_size_t(0), ctypes.c_char_p()
    tokens = None if sizing else np.full(max(capacity, 1) * 4096, np.nan, np.float32)  # wider than any width here
    pointer = None if sizing else tokens.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    status = verb(ctypes.byref(shape), modality, data, len(data), pointer, capacity, grid, ctypes.byref(count),
                  ctypes.byref(width), ctypes.byref(message))
    text = message.value.decode() if status else ""
    return status, text, tokens, tuple(grid), count.value, width.value


@needs_format("png")
def test_media_tokens_are_the_decoders_own_under_the_shapes_defaults():
    """The C verb with a zeroed shape derives a trainer's defaults (patches of 16 x 16 x 3, rows of 512) and
    answers what `uform_image_patches` answers with them; a NULL buffer sizes, a short one is refused whole."""
    data = png_bytes(picture(40, 70, seed=3))
    patches, grid = decoded(data, patch_side=16, channels=3, max_tokens=512)
    assert (grid["rows"], grid["columns"]) == (3, 4)
    status, _, _, sized, count, width = media_tokens_in_c(_Shape(), 2, data, 0, sizing=True)
    assert (status, sized, count, width) == (0, (1, 3, 4), 12, 16 * 16 * 3)
    for capacity in (12, 512):  # just enough, decoded aside and copied; a row's room, decoded in place
        status, _, tokens, answered, count, _ = media_tokens_in_c(_Shape(), 2, data, capacity)
        assert (status, answered, count) == (0, (1, 3, 4), 12)
        np.testing.assert_array_equal(tokens[:count * width].reshape(patches.shape), patches)
        assert np.isnan(tokens[count * width:]).all()  # nothing past the item's tokens
    status, message, tokens, _, count, _ = media_tokens_in_c(_Shape(), 2, data, 11)
    assert (status, count) == (1, 12) and message == "capacity: 11 tokens, but the item decodes to 12"
    assert np.isnan(tokens).all()


@needs_format("png", "wav")
def test_media_tokens_refusals_name_the_field():
    image, sound = png_bytes(picture(8, 8)), wav_bytes(tone(0.05, 16000), 16000)
    cases = [
        (_Shape(), 1, image, r"modality: 1 is not image \(2\), video \(3\) or audio \(4\); text has no media tokens"),
        (_Shape(), 9, image, r"modality: 9 is not image \(2\)"),
        (_Shape(), 2, sound, r"bytes: declared an image, but the bytes are audio \(wav\)"),
        (_Shape(), 4, image, r"bytes: declared audio, but the bytes are image \(png\)"),
        (_Shape(), 2, b"GIF89a" + bytes(20), "bytes: not an image file: its first bytes match no format"),
        (_Shape(image_channels=2), 2, image, r"shape.image.channels: 2 is not 1 \(gray\), 3 \(RGB\) or 4"),
        (_Shape(max_columns_per_row=20000), 2, image, "shape.max_columns_per_row: 20000 is over 16384"),
    ]
    for shape, modality, data, pattern in cases:
        status, message, tokens, _, _, _ = media_tokens_in_c(shape, modality, data, 512)
        assert status == 1 and re.match(pattern, message), message
        assert np.isnan(tokens).all()
    verb, count, message = media_tokens_verb(), ctypes.c_size_t(), ctypes.c_char_p()
    counted = ctypes.byref(count)
    for arguments, words in [((None, 2, image, len(image), None, 0, None, counted), b"shape: NULL"),
                             ((_Shape(), 2, image, len(image), None, 0, None, None), b"count: NULL output pointer"),
                             ((_Shape(), 2, None, 8, None, 0, None, counted), b"bytes: NULL with a length of 8")]:
        assert verb(*arguments, None, ctypes.byref(message)) == 1 and message.value.startswith(words)
    # grid, width and error may be NULL
    assert verb(_Shape(), 2, image, len(image), None, 0, None, counted, None, None) == 0 and count.value == 1


@needs_format("png", "wav")
def test_media_tokens_fitted_tells_what_a_row_cut():
    """`uform_media_tokens_fitted` answers what `uform_media_tokens` answers, and whether the item exceeded the
    row: an image shrunk, a sound cut at the end. Python's answer is the same pair, with `truncated`."""
    row = _Shape(max_columns_per_row=8, image_patch_side=8, audio_chunk_samples=300)
    items = [("image", png_bytes(picture(16, 24, seed=1)), False), ("image", png_bytes(picture(30, 50, seed=1)), True),
             ("audio", wav_bytes(tone(0.1, 16000), 16000), False), ("audio", wav_bytes(tone(0.5, 16000), 16000), True)]
    fitted = media_tokens_fitted_verb()
    for kind, data, cut in items:
        modality = {"image": 2, "audio": 4}[kind]
        for capacity in (0, 8):  # sizing, then filling
            grid, count, width, message = (ctypes.c_uint32 * 3)(), ctypes.c_size_t(), ctypes.c_size_t(), ctypes.c_char_p()
            truncated = ctypes.c_int(7)
            tokens = np.full(8 * 300, np.nan, np.float32)
            pointer = tokens.ctypes.data_as(ctypes.POINTER(ctypes.c_float)) if capacity else None
            status = fitted(ctypes.byref(row), modality, data, len(data), pointer, capacity, grid, ctypes.byref(count),
                            ctypes.byref(width), ctypes.byref(truncated), ctypes.byref(message))
            assert (status, truncated.value) == (0, int(cut)), message.value
            _, _, plain, plain_grid, plain_count, plain_width = media_tokens_in_c(row, modality, data, 8)
            assert (tuple(grid), count.value, width.value) == (plain_grid, plain_count, plain_width)
            if capacity:
                np.testing.assert_array_equal(tokens, plain[:len(tokens)])
        shape = dict(max_columns_per_row=8, image=dict(patch_side=8), audio=dict(chunk_samples=300))
        answer = uform.media_tokens(kind, data, shape)
        tokens, grid = answer  # still the pair it was
        assert isinstance(answer, uform.MediaTokens) and len(answer) == 2 and answer.truncated is cut
        assert grid == plain_grid and tokens.shape == (plain_count, plain_width)
    count = ctypes.c_size_t()
    assert fitted(ctypes.byref(row), 2, items[1][1], len(items[1][1]), None, 0, None, ctypes.byref(count), None, None,
                  None) == 0 and count.value == 6  # the report may be NULL, as the other outputs may


@needs_format("png", "wav")
def test_media_tokens_in_python_follow_the_shape_given():
    """`uform.media_tokens` takes a `BatchShape` or a dict, as a checkpoint's config records it."""
    image = png_bytes(picture(30, 50, seed=1))
    answer = uform.media_tokens("image", image, dict(max_columns_per_row=8, image=dict(patch_side=8, channels=1)))
    tokens, grid = answer
    patches, expected = decoded(image, patch_side=8, channels=1, max_tokens=8)
    assert grid == (1, 2, 3) == (expected["frames"], expected["rows"], expected["columns"]) and expected["truncated"]
    assert answer.truncated
    np.testing.assert_array_equal(tokens, patches.reshape(len(patches), -1))
    sound = wav_bytes(tone(0.1, 8000), 8000)
    chunks, grid = uform.media_tokens(uform.Modality.AUDIO, sound, uform.BatchShape(audio=uform.AudioShape(
        chunk_samples=300)))
    expected, _ = audio(sound, chunk_samples=300, max_tokens=512)
    assert grid == (len(expected), 1, 1) == (6, 1, 1)  # 1600 samples at 16 kHz, the last chunk padded
    np.testing.assert_array_equal(chunks, expected)
    # The argument is `content`, whichever check refuses it: Python's own or the C library's, which calls it `bytes`.
    for content, message in ((sound, r"declared an image, but the bytes are audio"), (b"", "an empty image"),
                             (b"GIF89a" + bytes(20), "not an image file"),
                             ("red panda", "expected the encoded file as bytes, got str"),
                             (np.zeros(4, np.float32), "expected a 1-D uint8 array")):
        with pytest.raises(uform.InvalidArgument, match=rf"^content: {message}"):
            uform.media_tokens("image", content)
    for given, named in (("text", "'text'"), ("TEXT", "'TEXT'"), (uform.Modality.TEXT, "'text'")):
        with pytest.raises(uform.InvalidArgument) as refused:  # named as given, not by the C library's numbers
            uform.media_tokens(given, b"red panda")
        assert str(refused.value) == f"modality: {named} is not a media modality (image, video or audio)"
    with pytest.raises(uform.InvalidArgument, match=r"^modality: 2 is not a Modality \(one of 'text', 'image'"):
        uform.media_tokens(2, image)
    with pytest.raises(uform.InvalidArgument, match="shape.image.patch_sides: unknown field"):
        uform.media_tokens("image", image, dict(image=dict(patch_sides=8)))


# ---------------------------------------------------------------------------------------------- #
#  Fuzzing's findings, replayed                                                                   #
# ---------------------------------------------------------------------------------------------- #

FINDINGS = os.path.join(os.path.dirname(__file__), "..", "fuzz", "corpus", "media")


@pytest.mark.parametrize("name", sorted(name for name in os.listdir(FINDINGS) if name.startswith("finding-")))
def test_fuzz_findings_refused(name):
    """Each input that once found a bug (fuzz/RESULTS.md) is now refused by name, allocating little."""
    with open(os.path.join(FINDINGS, name), "rb") as file:
        data = file.read()[6:]  # the first six bytes are fuzz/media.c's choice of call
    call = {"wav": audio, "mp4": video}[name.split("-")[1]]
    if name.split("-")[1] not in FORMATS:
        pytest.skip("this build does not decode the format")
    with pytest.raises(uform.InvalidArgument, match="batch.contents"):
        call(data)


@needs("ffmpeg")
@needs_format("mp4", "wav")
def test_sound_in_a_video_container_is_refused_with_a_hint(tmp_path):
    boxed = encode(wav_bytes(tone(0.2, 16000), 16000), tmp_path, "m4a", "-c:a", "aac")
    with pytest.raises(uform.InvalidArgument, match=r"declared audio, but the bytes are video \(mp4\); audio is read "
                                                    r"from WAV, FLAC, MP3 and Ogg files"):
        audio(boxed)
