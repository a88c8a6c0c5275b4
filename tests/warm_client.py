"""`python -S tests/warm_client.py SOCKET ARGS...`: runs `python ARGS...` as a child of the warm
server at SOCKET (tests/warm_python.py), or, where the server refuses or is gone, as a new
interpreter in this process's place. Signals that can be caught go on to the child; this process
exits as the child did (with its code, or killed by its signal). Standard library only, no site:
it starts in a few milliseconds."""
import json
import os
import signal
import socket
import sys

HEADER = 8   # as tests/warm_python.py's


def _python(args: list[str]) -> None:
  os.execv(sys.executable, [sys.executable] + args)


def _receive(conn: socket.socket) -> dict | None:
  data = b''
  while len(data) < HEADER or len(data) < HEADER + int.from_bytes(data[:HEADER], 'big'):
    chunk = conn.recv(1 << 16)
    if not chunk:
      return None
    data += chunk
  return json.loads(data[HEADER:])


def main(path: str, args: list[str]) -> None:
  if not args or (args[0].startswith('-') and (args[0] != '-m' or len(args) < 2)):
    _python(args)   # python's own options, -c, or nothing: only a new interpreter does those
  conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  try:
    conn.connect(path)
  except OSError:
    _python(args)
  data = json.dumps(dict(args=args, cwd=os.getcwd(), env=dict(os.environ))).encode()
  data = len(data).to_bytes(HEADER, 'big') + data
  try:
    sent = socket.send_fds(conn, [data], [0, 1, 2])
    conn.sendall(data[sent:])
    reply = _receive(conn)
  except OSError:   # a stream this process lacks, or a server that stopped
    reply = None
  if reply is None or 'refused' in reply:
    if os.environ.get('WARM_PYTHON_SAYS'):   # why it runs in a new interpreter, for a test's author
      print(f'warm python: {reply}', file=sys.stderr)
    conn.close()
    _python(args)
  pid = reply['pid']
  for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                 signal.SIGUSR2):
    signal.signal(number, lambda number, _: os.kill(pid, number))
  reply = _receive(conn)
  if reply is None:   # the server died with the child
    os._exit(1)
  status = reply['status']
  if os.WIFSIGNALED(status):
    signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
    os.kill(os.getpid(), os.WTERMSIG(status))
  os._exit(os.waitstatus_to_exitcode(status))


if __name__ == '__main__':
  main(sys.argv[1], sys.argv[2:])
