#!/usr/bin/env python3
"""The rubric's "device": true flags against what the test programs do without a device.

On a machine with no NVIDIA device the grader voids a module whose report says a test flagged
"device" passed (docs/SECURITY.md, row 33): the harness skips such a test there, so only a forged
report could say otherwise. A flag on a test that does run without a device would void honest
work on such a machine, and a missing flag would let a forged pass through. So, here (where there
is no device; elsewhere this exits 77, skipped), every test program of the rubric runs once on
the reference solutions (MPI modules on one rank, the MPI backend) and each test's outcome is
held to its flags: a "device" test skipped, a test skipped for want of a device flagged; an
"nccl" test skipped on MPI, a test skipped for want of NCCL flagged "nccl".

  device_flags_test.py BIN_DIR RUBRIC MPIEXEC
"""
import json
import os
import pathlib
import subprocess
import sys
import tempfile

SKIP = 77


def device_present():
    return any(p.name == "dxg" or (p.name.startswith("nvidia") and p.name[6:].isdigit()) for p in pathlib.Path("/dev").iterdir())


def outcomes(program, kind, report, mpiexec):
    """Test name -> (result, skip reason) from one run of `program`; raises RuntimeError when the
    run gives no report."""
    cmd = [str(program), f"--gtest_output=json:{report}"]
    if kind == "mpi":
        cmd = [mpiexec, "-n", "1", *cmd]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", K2C_BACKEND="mpi")
    env.pop("K2C_RUBRIC", None)
    try:
        subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900, check=False)
        text = pathlib.Path(report).read_text()
    except subprocess.TimeoutExpired:
        raise RuntimeError("ran past 900 s")
    except OSError:
        raise RuntimeError("wrote no report")
    got = {}
    for suite in json.loads(text)["testsuites"]:
        for t in suite["testsuite"]:
            why = t.get("k2c_skip", "") + "".join(s.get("message", "") for s in t.get("skipped", []))
            got[f"{suite['name']}.{t['name']}"] = (t.get("result", ""), why)
    return got


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    bin_dir, rubric, mpiexec = pathlib.Path(sys.argv[1]), json.loads(pathlib.Path(sys.argv[2]).read_text()), sys.argv[3]
    if device_present():
        print("an NVIDIA device is present: the flags are checked on a machine without one")
        return SKIP
    problems, checked = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for module in rubric["modules"]:
            program = bin_dir / f"k2c_test_{module['id']}"
            if not program.exists():
                continue
            try:
                got = outcomes(program, module["kind"], pathlib.Path(tmp) / f"{module['id']}.json", mpiexec)
            except RuntimeError as e:
                problems.append(f"{module['id']}: {program.name} {e}")
                continue
            for test in module["tests"]:
                result, why = got.get(test["name"], ("not run", ""))
                needs = "no CUDA device" in why or "needs the NCCL backend" in why
                flagged = test.get("device", False)
                checked += 1
                # A flagged test may skip for any reason here (a build without CUDA skips some for
                # want of the toolkit); what must never happen is that it passes or fails.
                if flagged and result != "SKIPPED":
                    problems.append(f"{module['id']}: {test['name']} is flagged \"device\" but ran here "
                                    f"({result}): honest work would be voided")
                on_nccl = "needs the NCCL backend" in why
                if test.get("nccl", False) and result != "SKIPPED":
                    problems.append(f"{module['id']}: {test['name']} is flagged \"nccl\" but ran on MPI "
                                    f"({result}): honest work would be voided")
                elif on_nccl and not test.get("nccl", False):
                    problems.append(f"{module['id']}: {test['name']} runs on NCCL only ({why}) and is not flagged "
                                    f"\"nccl\": a forged pass of it in an MPI run would stand")
                elif needs and not flagged:
                    problems.append(f"{module['id']}: {test['name']} needs a device ({why}) and is not flagged "
                                    f"\"device\": a forged pass of it would stand")
    for p in problems:
        print("FAIL:", p)
    if problems:
        return 1
    print(f"PASS: the \"device\" flags of {checked} tests agree with what their programs do without a device")
    return 0


if __name__ == "__main__":
    sys.exit(main())
