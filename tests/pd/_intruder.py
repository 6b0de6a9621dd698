"""A foreign party on the PD network: its own Mooncake engine, no cluster secret. Reads and
writes whatever registered memory of a node it can reach, as told by JSON lines on stdin:

  {"op": "base", "session": S}                          -> {"base": the peer's first buffer}
  {"op": "read", "session": S, "addr": A, "length": N, "out": FILE}   -> bytes into FILE
  {"op": "write", "session": S, "addr": A, "data": FILE}              -> FILE's bytes to A
"""
import json
import sys

import torch
from mooncake.engine import TransferEngine

LOCAL_BYTES = 256 << 20

if __name__ == "__main__":
    eng = TransferEngine()
    assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buf = torch.zeros(LOCAL_BYTES, dtype=torch.uint8)
    assert eng.register_memory(buf.data_ptr(), LOCAL_BYTES) == 0
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["op"] == "base":
                out = {"base": eng.get_first_buffer_address(cmd["session"])}
            elif cmd["op"] == "read":
                n = cmd["length"]
                rc = eng.transfer_sync_read(cmd["session"], buf.data_ptr(), cmd["addr"], n)
                with open(cmd["out"], "wb") as f:
                    f.write(buf[:n].numpy().tobytes())
                out = {"rc": rc}
            elif cmd["op"] == "write":
                data = open(cmd["data"], "rb").read()
                buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                out = {"rc": eng.transfer_sync_write(cmd["session"], buf.data_ptr(), cmd["addr"], len(data))}
            else:
                out = {"error": f"unknown op {cmd['op']}"}
        except Exception as e:  # noqa: BLE001 - report, keep serving
            out = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(out), flush=True)
