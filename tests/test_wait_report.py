"""The host's half of a GPU's report of an expired wait (`runtime/wait_report.py`), checked on any
machine: the page maps at its fixed address, a slot written as `_gpu._report_and_trap` writes it
(its magic word last) becomes the same line the emulator gives, and a slot without its magic word
(a program stopped by another's trap while writing) is no report. The emulator's line is checked in
test_language.py and, through `tridist run`, in test_launcher.py."""
import ctypes

from tridist.runtime import wait_report


def _write_slot(slot: int, magic: bool = True, **fields) -> None:
    base = wait_report.REPORT_ADDRESS + slot * wait_report.WORDS * 8
    for index, name in enumerate(wait_report.FIELDS[1:], start=1):
        ctypes.c_int64.from_address(base + 8 * index).value = fields.get(name, 0)
    if magic:
        ctypes.c_int64.from_address(base).value = wait_report.MAGIC


def test_gpu_report_page_gives_the_emulators_line():
    wait_report.map_page()
    assert wait_report.problem() is None
    wait_report.clear()

    def name_of(address):
        return f"flags[{(address - 0x7000) // 8}] (int64[4] at heap offset 0x7000)"

    assert wait_report.take(0, "some_kernel", name_of) is None
    _write_slot(5, magic=False, kind=wait_report.KIND_SIGNAL, program=5, address=0x7008, expected=3)
    assert wait_report.take(0, "some_kernel", name_of) is None
    _write_slot(3, kind=wait_report.KIND_SIGNAL, program=67, address=0x7010, comparison=5, expected=3, observed=2,
                elapsed_ns=5_012_000_000)
    assert wait_report.take(1, "some_kernel", name_of) == (
        "tridist: rank 1 kernel some_kernel program 67: wait on flags[2] (int64[4] at heap offset 0x7000) "
        "expected >= 3, observed 2 after 5.0 s")
    assert wait_report.read() == []  # taken: the page is clear for the next report
    _write_slot(0, kind=wait_report.KIND_PACKETS, program=0, address=0x7018, comparison=0, expected=7, observed=6,
                elapsed_ns=1_000_000_000, stale=12)
    assert wait_report.take(0, "ll_kernel", name_of).endswith(
        "wait on flags[3] (int64[4] at heap offset 0x7000) expected == 7, observed 6 after 1.0 s "
        "(the flag of an LL packet; 12 packets stale)")
