"""The C kernels' cached build (stopline/model/kernels/native.py): keyed by every source the
compiler reads, headers included, so an edited header (csrc/int8_epilogue.h, panel.h) rebuilds
the library instead of loading a stale one."""

from __future__ import annotations

import ctypes
import platform

import pytest

from stopline.model.kernels import native

pytestmark = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                                reason="the kernels' flags are x86-64's")


def test_every_header_is_part_of_the_key() -> None:
    names = {h.name for h in native._HEADERS}
    assert names == {h.name for h in native._CSRC.glob("*.h")}
    assert {"int8_epilogue.h", "panel.h"} <= names


def test_an_edited_header_rebuilds_the_library(tmp_path, monkeypatch) -> None:
    try:
        cc = native._compiler()
    except native.NativeUnavailable as e:
        pytest.skip(str(e))
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "k.c").write_text('#include "k.h"\nint stopline_k(void) { return K; }\n')
    (src / "k.h").write_text("#define K 1\n")
    monkeypatch.setattr(native, "_SOURCES", [src / "k.c"])
    monkeypatch.setattr(native, "_HEADERS", [src / "k.h"])
    out = tmp_path / "native"
    first = native._build(cc, out)
    assert native._build(cc, out) == first  # unchanged sources: the cached build
    assert ctypes.CDLL(str(first)).stopline_k() == 1
    (src / "k.h").write_text("#define K 2\n")
    second = native._build(cc, out)
    assert second != first
    assert ctypes.CDLL(str(second)).stopline_k() == 2
