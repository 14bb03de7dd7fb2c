#!/usr/bin/env python3
"""cut_ptx.py SRC DST: copies the CUDA kernel sources of variants 2 and 3 from
SRC (the repository's backends/cuda) to DST (a build folder, mirrored as
DST/backends/cuda) for the CPU emulator of test_cuda_emu: the inline-PTX
sections are replaced by the emulated wrappers (emu_ptx_*.h), the host sides
are cut off, and `extern __shared__` arrays become the emulator's shared
memory. Fails (exit 1) when a marker it relies on is missing, so that a
renamed section cannot silently leave real PTX in the CPU build."""
import os
import sys


def cut(s, a, b, what):
    if a not in s or b not in s[s.index(a):]:
        sys.exit(f"cut_ptx.py: marker {a!r} or {b!r} not found in {what}")
    i = s.index(a)
    j = s.index(b, i)
    return s[:i], s[j + len(b):]


def main():
    src, dst = sys.argv[1], os.path.join(sys.argv[2], 'backends', 'cuda')
    os.makedirs(dst, exist_ok=True)
    read = lambda f: open(os.path.join(src, f)).read()

    def write(f, s):
        path = os.path.join(dst, f)
        if not os.path.exists(path) or open(path).read() != s:
            open(path, 'w').write(s)

    s = read('attn_mma_common.cuh')
    pre, post = cut(s, '/* ---- PTX wrappers (the only inline assembly of this file) ---- */',
                    '/* ---- end of PTX wrappers ---- */', 'attn_mma_common.cuh')
    write('attn_mma_common.cuh', pre + '#include "emu_ptx_mma1.h"\n' + post)

    s = read('attn_mma2_common.cuh')
    pre, post = cut(s, '/* ---- PTX wrappers of variant 2 ---- */',
                    '/* ---- end of PTX wrappers of variant 2 ---- */', 'attn_mma2_common.cuh')
    s = pre + '#include "emu_ptx_mma2.h"\n' + post
    pre, post = cut(s, '/* ---- host side ---- */', '} /* namespace mma2 */', 'attn_mma2_common.cuh')
    write('attn_mma2_common.cuh', pre + '} /* namespace mma2 */' + post)

    s = read('attn_wgmma_ptx.cuh')
    pre, post = cut(s, '/* ---- PTX wrappers of variant 3 ---- */',
                    '/* ---- end of PTX wrappers of variant 3 ---- */', 'attn_wgmma_ptx.cuh')
    write('attn_wgmma_ptx.cuh', pre + '#include "emu_ptx_wgmma.h"\n' + post)

    for f, ns in (('attn_mma2_fwd.cu', 'mma2'), ('attn_mma2_bwd.cu', 'mma2'),
                  ('attn_wgmma_fwd.cu', 'wg'), ('attn_wgmma_bwd.cu', 'wg')):
        s = read(f)
        if '/* ---- host side ---- */' not in s:
            sys.exit(f"cut_ptx.py: no host-side marker in {f}")
        s = s[:s.index('/* ---- host side ---- */')] + '} /* namespace %s */\n' % ns
        n = 0
        for align in ('128', '1024'):
            decl = 'extern __shared__ __align__(%s) unsigned char smem[];' % align
            n += s.count(decl)
            s = s.replace(decl, 'unsigned char *smem = emu::smem_base();')
        if n == 0:
            sys.exit(f"cut_ptx.py: no shared-memory declaration in {f}")
        write(f, s)
    for f in ('cuda_device.cuh', 'cuda_internal.h', 'attn_mma2.h', 'attn_wgmma.h',
              'attn_wgmma_fwd_common.cuh'):
        write(f, read(f))


if __name__ == '__main__':
    main()
