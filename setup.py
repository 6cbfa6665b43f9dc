"""Builds `libuform.so` once, the Cython extensions over it, and the CUDA plug-in where it can.

`uform/libuform.so` is compiled from libuform/src/*.c and libuform/src/ram/*.c as C99 with hidden
visibility, so it exports what `uform.h` declares and the few hooks that the core's headers mark
`UFORM_API` for the tests and the CUDA plug-in, nothing else. `uform._native` and `uform._testing`
hold only their Cython output and link it through an `$ORIGIN` run path: a process has one copy of
the library, of its table of handles and of its error messages.

The CPU backend's matrix products call OpenBLAS from the `scipy-openblas32` wheel, which ships the
library and its `cblas.h` for exactly this use; `libuform.so` finds it through a run path relative
to the installed package. An in-place build's `uform/` is the checkout's, not a sibling of the
wheel's folder, so it also gets the absolute folder it was built against, unless that folder belongs
to a temporary build environment.

The CUDA backend, libuform/src/vram/, becomes `uform/libuform_vram.so`, which `libuform.so` opens
with `dlopen` only when a VRAM executor is asked for, so `libuform.so` loads on any machine. It is
built when nvcc and the headers of CUDA, cuBLASLt, cuDNN and cudnn-frontend are found; see
`CudaToolchain`. UFORM_CUDA=0 skips it, UFORM_CUDA=1 makes anything missing an error.

Media decoders (libjpeg-turbo, libpng, libwebp, FFmpeg's libraries) are linked into `libuform.so`
where `pkg-config` finds them; see `media_decoders`.
"""
import concurrent.futures
import glob
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import tempfile

import numpy
import scipy_openblas32
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

include_dirs = ["libuform/include", "libuform/src"]
sanitize = os.environ.get("UFORM_SANITIZE")  # e.g. "address,undefined" for a checked build
# uform builds from source where it runs, so it may use every vector unit of this CPU; set
# UFORM_MARCH=x86-64 (or another -march value) for a build that must run on other machines.
march = os.environ.get("UFORM_MARCH", "native")
compile_args = ["-O3", f"-march={march}", "-Wall", "-Wno-unused-function"]
link_args = []
if sanitize:
    # Every report is fatal: UBSan's checks stop the process rather than print and carry on.
    checked = [f"-fsanitize={sanitize}", "-fno-sanitize-recover=all"]
    compile_args += ["-O1", "-g", "-fno-omit-frame-pointer"] + checked
    link_args += checked
# The library is the C99 the README promises, with POSIX 2008 for threads and files. A function
# C99 does not declare must stop the build: implicitly declared, it would return a truncated int.
library_compile_args = ["-std=c99", "-D_POSIX_C_SOURCE=200809L", "-pedantic", "-Werror=implicit-function-declaration",
                        "-fvisibility=hidden", "-fopenmp", "-pthread", "-fno-math-errno"]
# The soname lets a process that reaches the library by two paths map it once.
library_link_args = ["-fopenmp", "-pthread", "-Wl,-soname,libuform.so"]


def lasting(path):
    """Whether a folder outlives the build: pip's isolated build environment lies under the
    temporary folder, while the environment of the Python that runs the build does not."""
    path, prefix, temporary = (os.path.realpath(folder) for folder in (path, sys.prefix, tempfile.gettempdir()))
    return os.path.commonpath([path, prefix]) == prefix or os.path.commonpath([path, temporary]) != temporary


def first(paths):
    return next((path for path in paths if os.path.isfile(path)), None)


class CudaToolchain:
    """nvcc, the include folders and the library files the CUDA plug-in needs, or `missing`.

    Headers and libraries are looked for under the toolkit of the nvcc found, UFORM_CUDA_PATHS
    (colon-separated roots), $CUDA_HOME, /usr/local/cuda, and every site-packages folder this
    build sees, each as a prefix (`include/`, `lib64/`, `lib/`) and in NVIDIA's wheel layouts:
    CUDA 13's toolkit wheels share nvidia/cu13/, cuDNN's is nvidia/cudnn/, CUDA 12's have a folder
    each, and nvidia-cudnn-frontend puts its headers straight into site-packages/include/.
    """

    # cuda_runtime.h first, from the toolkit of the nvcc found, so that its headers come before a
    # wheel's, which may be of a newer CUDA; nvrtc.h because cudnn_frontend.h includes it.
    headers = ("cuda_runtime.h", "cublasLt.h", "cudnn.h", "cudnn_frontend.h", "nvrtc.h")
    libraries = ("cudart", "cublasLt", "cudnn", "nvrtc")  # cudnn-frontend's runtime-compiled engines call NVRTC
    wheel_folders = ("nvidia/cu13", "nvidia/cudnn", "nvidia/cublas", "nvidia/cuda_runtime")

    def __init__(self):
        homes = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]
        self.nvcc = shutil.which("nvcc") or shutil.which("nvcc", path=os.pathsep.join(
            os.path.join(home, "bin") for home in homes if home))
        if not self.nvcc:
            self.missing = ["nvcc (on PATH, in $CUDA_HOME/bin or /usr/local/cuda/bin)"]
            return
        toolkit = os.path.dirname(os.path.dirname(os.path.realpath(self.nvcc)))
        bases = [toolkit] + os.environ.get("UFORM_CUDA_PATHS", "").split(":") + homes
        bases += sys.path + [sysconfig.get_paths()["purelib"]] + site.getsitepackages()
        roots = [root for root in dict.fromkeys(os.path.join(base, folder) for base in bases if base
                                                for folder in ("",) + self.wheel_folders) if os.path.isdir(root)]
        headers = {name: first(os.path.join(root, "include", name) for root in roots) for name in self.headers}
        libraries = {name: first(path for root in roots for folder in ("lib64", "lib")
                                 for path in sorted(glob.glob(os.path.join(root, folder, f"lib{name}.so*"))))
                     for name in self.libraries}
        self.missing = [name for name, path in headers.items() if not path]
        self.missing += [f"lib{name}.so" for name, path in libraries.items() if not path]
        self.include_dirs = list(dict.fromkeys(os.path.dirname(path) for path in headers.values() if path))
        self.library_files = list(libraries.values())

    def run_paths(self):
        """Where the plug-in looks for its libraries: beside the wheels' folders in site-packages,
        then where this build found them, unless that was a temporary build environment."""
        relative = [f"$ORIGIN/../{folder}/lib" for folder in self.wheel_folders]
        found = [os.path.dirname(path) for path in self.library_files if lasting(os.path.dirname(path))]
        return list(dict.fromkeys(relative + found))


class BuildExt(build_ext):
    """Builds `libuform.so` first, then the extensions against it, then the CUDA plug-in."""

    def get_ext_filename(self, name):
        if name.split(".")[-1] == "libuform":  # asked with the full name or its last part alone
            return os.path.join(*name.split(".")[:-1], "libuform.so")
        return super().get_ext_filename(name)

    def get_export_symbols(self, ext):
        return [] if ext.name == "uform.libuform" else super().get_export_symbols(ext)

    def build_extensions(self):
        # The link line of the Python that builds may carry a run path to its own folder (pyenv's
        # does): a build machine's path that no installed object should keep.
        self.compiler.linker_so = [word for word in self.compiler.linker_so if not word.startswith("-Wl,-rpath,")]
        super().build_extensions()

    def build_extension(self, ext):
        library_dir = os.path.dirname(self.get_ext_fullpath("uform.libuform"))
        if ext.name == "uform.libuform":
            openblas = scipy_openblas32.get_lib_dir()
            absolute = [openblas] if self.in_place and lasting(openblas) else []
            ext.runtime_library_dirs = ["$ORIGIN/../scipy_openblas32/lib"] + absolute
        else:
            ext.library_dirs = [library_dir]
        super().build_extension(ext)

    def run(self):
        # setuptools builds in-place extensions in the build folder, with `inplace` off, then copies them.
        self.in_place = self.inplace
        super().run()  # the extensions, in the order listed: `libuform.so` first
        library_dir = os.path.dirname(self.get_ext_fullpath("uform.libuform"))
        if not self.in_place:  # an in-place build reads the header from the checkout, where it lives
            self.mkpath(os.path.join(library_dir, "include"))
            self.copy_file("libuform/include/uform.h", os.path.join(library_dir, "include", "uform.h"))
        self.build_cuda(os.path.join(library_dir, "libuform_vram.so"))

    def build_cuda(self, target):
        wanted = os.environ.get("UFORM_CUDA", "")
        if wanted == "0":
            return print("uform: CUDA backend not built: UFORM_CUDA=0")
        toolchain = CudaToolchain()
        if toolchain.missing:
            reason = "missing " + ", ".join(toolchain.missing) + " (UFORM_CUDA_PATHS adds roots to search)"
            if wanted == "1":
                sys.exit(f"uform: UFORM_CUDA=1, but the CUDA backend cannot be built: {reason}")
            return print(f"uform: CUDA backend not built: {reason}")
        # nvcc hands a .cpp file to the host compiler alone, one pass instead of one per architecture
        # plus the host's: the place for host code behind heavy headers (cudnn_frontend.h: 1 minute, not 4).
        cuda_sources = sorted(glob.glob("libuform/src/vram/*.cu") + glob.glob("libuform/src/vram/*.cpp"))
        if not cuda_sources:
            return print("uform: CUDA backend not built: libuform/src/vram/ has no .cu or .cpp sources")
        objects_dir = os.path.join(self.build_temp, "vram")
        os.makedirs(objects_dir, exist_ok=True)
        includes = [f"-I{folder}" for folder in include_dirs + toolchain.include_dirs]
        nvcc_args = ["-std=c++17", "-O3", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden",
                     "-gencode=arch=compute_90a,code=sm_90a", "-gencode=arch=compute_90,code=compute_90",
                     "--expt-relaxed-constexpr", "-DNV_CUDNN_FRONTEND_DISABLE_LOGGING"]

        def compile_cuda(source):
            output = os.path.join(objects_dir, os.path.basename(source) + ".o")
            subprocess.run([toolchain.nvcc, *nvcc_args, *includes, "-c", source, "-o", output], check=True)
            return output

        # nvcc compiles one file on one core: as many at once as there are cores.
        with concurrent.futures.ThreadPoolExecutor(os.cpu_count()) as pool:
            objects = list(pool.map(compile_cuda, cuda_sources))
        objects += self.compiler.compile(sorted(glob.glob("libuform/src/vram/*.c")), output_dir=self.build_temp,
                                         include_dirs=include_dirs + toolchain.include_dirs,
                                         extra_postargs=compile_args + library_compile_args)
        # nvcc's host compiler links: the wheels' libraries are versioned files nvcc will not take.
        # -z defs: a symbol the plug-in leaves unresolved fails here, not at dlopen on a GPU machine;
        # --as-needed: a library it does not call is not loaded with it.
        run_paths = [f"-Wl,-rpath,{folder}" for folder in toolchain.run_paths()]
        subprocess.run([os.environ.get("CXX", "g++"), "-shared", "-o", target, *objects, "-Wl,--as-needed",
                        *toolchain.library_files, "-Wl,-z,defs", *run_paths,
                        # Its own C++ runtime, kept private: the host process may have loaded an older libstdc++
                        # than the compiler's, and the frontend's streams crashed against one.
                        "-static-libstdc++", "-static-libgcc", "-Wl,--exclude-libs,ALL"], check=True)
        print(f"uform: CUDA backend built: {target}")


def media_decoders():
    """The `UFORM_MEDIA_*` defines of the decoders `pkg-config` finds, with their compile and link flags.

    Each family of formats is built where all of its libraries are found and left out otherwise;
    libuform/src/media/ then refuses its formats by name, with the Debian package that adds them.
    """
    families = {  # the define libuform/src/media/ reads: the pkg-config packages it needs
        "UFORM_MEDIA_JPEG": ["libjpeg"],  # libjpeg-turbo's, for its RGBA output
        "UFORM_MEDIA_PNG": ["libpng"],
        "UFORM_MEDIA_WEBP": ["libwebp"],
        "UFORM_MEDIA_FFMPEG": ["libavformat", "libavcodec", "libavutil", "libswresample", "libswscale"],
    }
    defines, compile_flags, link_flags, missing = [], [], [], []
    for define, packages in families.items():
        try:
            flags = [subprocess.run(["pkg-config", option, *packages], check=True, capture_output=True,
                                    text=True).stdout.split() for option in ("--cflags", "--libs")]
        except (OSError, subprocess.CalledProcessError):
            missing.append(" ".join(packages))
            continue
        defines.append((define, "1"))
        compile_flags += flags[0]
        link_flags += flags[1]
    found = ", ".join(define[len("UFORM_MEDIA_"):].lower() for define, _ in defines) or "none"
    print(f"uform: media decoders: {found}" + (f"; not found by pkg-config: {', '.join(missing)}" if missing else ""))
    return defines, list(dict.fromkeys(compile_flags)), list(dict.fromkeys(link_flags))


media_defines, media_compile_args, media_link_args = media_decoders()
library = Extension("uform.libuform", sorted(glob.glob("libuform/src/*.c") + glob.glob("libuform/src/ram/*.c") +
                                             glob.glob("libuform/src/media/*.c")),
                    include_dirs=include_dirs + [scipy_openblas32.get_include_dir()],
                    library_dirs=[scipy_openblas32.get_lib_dir()],
                    libraries=[scipy_openblas32.get_library(), "dl"],
                    define_macros=media_defines,
                    extra_compile_args=compile_args + library_compile_args + media_compile_args,
                    extra_link_args=link_args + library_link_args + media_link_args)


def extension(name):
    return Extension(name, [f"{name.replace('.', '/')}.pyx"], include_dirs=include_dirs + [numpy.get_include()],
                     libraries=["uform"], runtime_library_dirs=["$ORIGIN"],
                     extra_compile_args=compile_args, extra_link_args=link_args)


setup(
    ext_modules=[library] + cythonize(
        [extension("uform._native"), extension("uform._testing")],
        compiler_directives=dict(language_level=3, boundscheck=False, wraparound=False),
    ),
    cmdclass=dict(build_ext=BuildExt),
    # A checked build keeps its objects apart, so neither build ever links the other's.
    options=dict(build=dict(build_base="build/sanitize")) if sanitize else {},
    package_data={"uform": ["*.pyx", "*.pxd"]},
)
