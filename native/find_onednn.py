"""Print the install prefix of the onednn-devel-cpu-gomp wheel (its include/ and lib/ sit under it).

The wheel ships headers as data files, which pip puts under the prefix of the environment it
installs into (for an isolated build, pip's temporary build environment).
"""

from __future__ import annotations

import importlib.metadata as md
import pathlib
import sys

dist = md.distribution("onednn-devel-cpu-gomp")
for f in dist.files or ():
    if str(f).replace("\\", "/").endswith("include/oneapi/dnnl/dnnl.hpp"):
        header = pathlib.Path(dist.locate_file(f)).resolve()
        print(header.parents[3])  # <prefix>/include/oneapi/dnnl/dnnl.hpp -> <prefix>
        sys.exit(0)
sys.exit("onednn-devel-cpu-gomp has no include/oneapi/dnnl/dnnl.hpp")
