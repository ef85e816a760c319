'use strict';
/**
 * paramsync for Node.js: torch.distributed's collectives as gRPC calls to
 * paramsyncd, in place on typed arrays, one promise per collective.
 *
 *   const dist = require('paramsync');
 *   await dist.initProcessGroup();                 // env://, like torch
 *   const t = new Float32Array([dist.getRank() + 1]);
 *   await dist.allReduce(t, { op: dist.ReduceOp.SUM });
 *   await dist.destroyProcessGroup();              // or the process stays up
 *
 * Names are Python's in camelCase (allReduce, allGather, reduceScatter, ...),
 * and the snake_case names are exported too (all_reduce, ...). Arguments
 * that torch takes positionally (src, dst, lists) are positional here;
 * the optional ones (op, group, tag, dtype) go in a trailing options object.
 * src/dst are global ranks, as in torch. Every collective is started (its
 * sequence number taken) when it is called, so promises may be awaited in
 * any order: that is torch's async_op=True. The object collectives
 * (allGatherObject, ...) and allToAllSingle with split sizes are the
 * exception: they take two collectives, so the next collective on their
 * group starts after they resolve.
 *
 * Typed arrays map to dtypes: Float32Array float32, Float64Array float64,
 * Int8Array int8, Uint8Array (and Buffer) uint8, Int16Array int16,
 * Int32Array int32, BigInt64Array int64. float16 and bfloat16 travel in a
 * Uint16Array with { dtype: 'float16' } or { dtype: 'bfloat16' }; bool in a
 * Uint8Array with { dtype: 'bool' }. Anything else is a TypeError.
 */
const crypto = require('crypto');
const fs = require('fs');
const os = require('os');
const path = require('path');
const v8 = require('v8');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const protobuf = require('protobufjs');

// ------------------------------------------------------------------ the contract

function protoDir() {
  const candidates = [process.env.PARAMSYNC_PROTO_DIR, path.join(__dirname, 'proto'),
    path.join(__dirname, '..', '..', 'proto')].filter(Boolean);
  for (const d of candidates) {
    if (fs.existsSync(path.join(d, 'paramsync', 'v1', 'paramsync.proto'))) return d;
  }
  throw new Error('paramsync: cannot find paramsync/v1/paramsync.proto (looked in ' +
    candidates.join(', ') + '); set PARAMSYNC_PROTO_DIR to the repository\'s proto/');
}

const packageDefinition = protoLoader.loadSync('paramsync/v1/paramsync.proto', {
  includeDirs: [protoDir()], keepCase: true, longs: String, enums: Number, defaults: true,
});
const pb = grpc.loadPackageDefinition(packageDefinition).paramsync.v1;

const ReduceOp = Object.freeze({ SUM: 0, PRODUCT: 1, MIN: 2, MAX: 3, BAND: 4, BOR: 5, BXOR: 6,
  AVG: 7 });
const OP_NAMES = Object.keys(ReduceOp);
const DTYPES = Object.freeze({ float32: 0, float64: 1, float16: 2, bfloat16: 3, int8: 4,
  uint8: 5, int16: 6, int32: 7, int64: 8, bool: 9 });
const DTYPE_NAMES = Object.keys(DTYPES);
const FLOATING = new Set([0, 1, 2, 3]);
const BITWISE = new Set([ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR]);
const KIND = Object.freeze({ BARRIER: 1, BROADCAST: 2, ALL_REDUCE: 3, REDUCE: 4, ALL_GATHER: 5,
  GATHER: 6, SCATTER: 7, REDUCE_SCATTER: 8, ALL_TO_ALL: 9, SEND: 10, RECV: 11 });
const JOIN = Object.freeze({ READY: 1, MEMBER_LOST: 2, JOB_ABORTED: 3 });
const STATUS_NAMES = Object.fromEntries(Object.entries(grpc.status).map(([k, v]) => [v, k]));

// ------------------------------------------------------------------ errors

/** An error from the daemon (or the connection to it): code is the gRPC status code,
 * codeName its name, details the daemon's message (it names the ranks and the field). */
class ParamsyncError extends Error {
  constructor(message, code, details) {
    super(message);
    this.name = 'ParamsyncError';
    this.code = code;
    this.codeName = STATUS_NAMES[code] || 'UNKNOWN';
    this.details = details === undefined ? message : details;
  }
}

/** What to do about a connection the agent dropped for an unanswered liveness ping. */
function keepaliveHint(details) {
  if (!/keepalive/i.test(details)) return '';
  return ' (the agent drops a connection that leaves its liveness ping unanswered for ' +
    'about its --liveness-timeout-ms, 10 s by default; a Node.js event loop kept busy ' +
    'that long cannot answer it: move long synchronous work to a worker thread, or ' +
    'raise the agent\'s --liveness-timeout-ms)';
}

function makeError(what, code, details) {
  const name = STATUS_NAMES[code] || 'UNKNOWN';
  if (details.startsWith(what)) return new ParamsyncError(`${name}: ${details}`, code, details);
  return new ParamsyncError(`${what}: ${name}: ${details}`, code, details);
}

// ------------------------------------------------------------------ tensors

const NATURAL = [
  [Float32Array, 'float32'], [Float64Array, 'float64'], [Int8Array, 'int8'],
  [Int16Array, 'int16'], [Int32Array, 'int32'], [BigInt64Array, 'int64'],
];
// dtypes a typed array may carry when the caller names them.
const ALLOWED = {
  float32: [Float32Array], float64: [Float64Array], int8: [Int8Array], int16: [Int16Array],
  int32: [Int32Array], int64: [BigInt64Array], uint8: [Uint8Array], bool: [Uint8Array],
  float16: [Uint16Array], bfloat16: [Uint16Array],
};

function isTensor(t) {
  return ArrayBuffer.isView(t) && !(t instanceof DataView);
}

/** { dtype, numel, buf }: buf is a Buffer sharing t's memory. */
function view(t, what, dtype) {
  if (!isTensor(t)) {
    const kind = t === null ? 'null' : Array.isArray(t) ? 'an Array' : typeof t === 'object'
      ? (t.constructor && t.constructor.name) || 'an object' : typeof t;
    throw new TypeError(`${what} must be a typed array (Float32Array, ..., BigInt64Array), ` +
      `not ${kind}`);
  }
  let name;
  if (dtype !== undefined && dtype !== null) {
    name = typeof dtype === 'number' ? DTYPE_NAMES[dtype] : String(dtype);
    const ok = ALLOWED[name];
    if (!ok) {
      throw new TypeError(`${what}: unknown dtype ${JSON.stringify(dtype)} (one of ` +
        `${DTYPE_NAMES.join(', ')})`);
    }
    if (!ok.some((c) => t instanceof c) || t instanceof Uint8ClampedArray) {
      throw new TypeError(`${what}: dtype ${name} travels in a ${ok.map((c) => c.name)
        .join(' or ')}, not a ${t.constructor.name}`);
    }
  } else if (t instanceof Uint8Array && !(t instanceof Uint8ClampedArray)) {
    name = 'uint8';
  } else {
    const hit = NATURAL.find(([c]) => t instanceof c);
    if (!hit) {
      const hint = t instanceof Uint16Array ? ' (pass { dtype: \'float16\' } or ' +
        '{ dtype: \'bfloat16\' } for half precision)' : '';
      throw new TypeError(`${what}: paramsync does not support ${t.constructor.name}${hint}; ` +
        'supported: Float32Array, Float64Array, Int8Array, Uint8Array, Int16Array, ' +
        'Int32Array, BigInt64Array, and Uint16Array as float16/bfloat16');
    }
    name = hit[1];
  }
  return { dtype: DTYPES[name], numel: t.length,
    buf: Buffer.from(t.buffer, t.byteOffset, t.byteLength), tensor: t };
}

/** A payload made of several buffers end to end. */
class Segments {
  constructor(views) {
    this.bufs = views.map((v) => v.buf).filter((b) => b.length > 0);
    this.starts = [];
    let pos = 0;
    for (const b of this.bufs) { this.starts.push(pos); pos += b.length; }
    this.total = pos;
  }

  * chunks(size) {
    let pending = [];
    let have = 0;
    for (const b of this.bufs) {
      let pos = 0;
      while (pos < b.length) {
        const take = Math.min(size - have, b.length - pos);
        pending.push(b.subarray(pos, pos + take));
        have += take;
        pos += take;
        if (have === size) {
          yield pending.length === 1 ? Buffer.from(pending[0]) : Buffer.concat(pending);
          pending = [];
          have = 0;
        }
      }
    }
    if (have) yield pending.length === 1 ? Buffer.from(pending[0]) : Buffer.concat(pending);
  }

  write(offset, data) {
    if (offset + data.length > this.total) return false;
    let i = 0;
    while (i + 1 < this.starts.length && this.starts[i + 1] <= offset) i++;
    let done = 0;
    while (done < data.length) {
      const b = this.bufs[i];
      const at = offset + done - this.starts[i];
      const take = Math.min(b.length - at, data.length - done);
      data.copy(b, at, done, done + take);
      done += take;
      i++;
    }
    return true;
  }
}

function overlaps(as, bs) {
  for (const a of as) {
    for (const b of bs) {
      if (!a.buf.length || !b.buf.length || a.buf.buffer !== b.buf.buffer) continue;
      const a0 = a.buf.byteOffset; const b0 = b.buf.byteOffset;
      if (a0 < b0 + b.buf.length && b0 < a0 + a.buf.length) return true;
    }
  }
  return false;
}

/** Copies inputs that share memory with outputs (results must not overwrite unsent bytes). */
function snapshot(ins, outs) {
  if (!overlaps(ins, outs)) return ins;
  return ins.map((v) => ({ ...v, buf: Buffer.from(v.buf) }));
}

// ------------------------------------------------------------------ shared memory

/*
 * The shared-memory path (client/shm.c's rules, as the Python client's
 * _shm.py): when the agent runs on this host, a collective whose input plus
 * output reach SHM_MIN_BYTES goes through a POSIX segment the agent maps. The
 * worker writes its input into the segment, sends only the header, and reads
 * its output back once the call has succeeded. Node cannot map memory, but a
 * POSIX segment is a file in /dev/shm: pwrite and pread on it touch the very
 * pages the agent maps, one copy each way, as memcpy into a mapping would be.
 * One segment per World (its groups share it), grown by doubling, used by one
 * collective at a time (a concurrent one takes frames). PARAMSYNC_SHM=0 turns
 * it off; an agent that cannot map it (another host, another /dev/shm) turns
 * it off for the World for good.
 */
const SHM_MIN_BYTES = 64 << 10;
const SHM_ALIGN = 4096;
// Segments beyond the first for collectives in flight beside the one using it.
const SHM_SPARES = 3;
let shmCounter = 0;

function shmEnabled() { return process.env.PARAMSYNC_SHM !== '0'; }

/** The agent will never map this World's segments: stay on gRPC frames. */
class ShmRefused extends Error {}

/** [output offset, segment bytes needed]: all_reduce and reduce write their output over
 * the input (offset 0); other kinds put it after the input, a page aligned. */
function shmLayout(inPlace, inBytes, outBytes) {
  if (inPlace) return [0, Math.max(inBytes, outBytes)];
  const outOff = Math.ceil(inBytes / SHM_ALIGN) * SHM_ALIGN;
  return [outOff, outOff + outBytes];
}

function pwriteAll(fd, buf, pos) {
  for (let done = 0; done < buf.length;) {
    done += fs.writeSync(fd, buf, done, buf.length - done, pos + done);
  }
}

function preadAll(fd, buf, pos) {
  for (let done = 0; done < buf.length;) {
    const n = fs.readSync(fd, buf, done, buf.length - done, pos + done);
    if (n === 0) throw new Error('the shared segment is shorter than its result');
    done += n;
  }
}

class ShmSegment {
  /** attach(name, size, magic) resolves to the ShmAttachResponse once the agent mapped
   * the segment; rejects with ShmRefused when it never will, with anything else for this
   * time only. */
  constructor(attach) {
    this.attach = attach;
    this.slots = 1; // payload slots the agent keeps for the rank (ShmAttachResponse)
    this.fd = null;
    this.name = null;
    this.size = 0;
    this.inUse = false;
    this.disabled = false;
    this.closed = false;
    this.refused = ''; // why the agent refused our segments, once it has
  }

  /** Claims the segment for one collective, grown to fit, with its input written in.
   * Resolves to the output offset, or null: this collective takes gRPC frames. rung: the
   * doorbell carries it (no call), so any size goes. */
  async begin(inPlace, send, recv, rung = false) {
    const inBytes = send ? send.total : 0;
    const outBytes = recv ? recv.total : 0;
    if ((!rung && inBytes + outBytes < SHM_MIN_BYTES) || !shmEnabled()) return null;
    if (this.disabled || this.closed || this.inUse) return null;
    this.inUse = true; // before any await: a concurrent collective takes frames
    const [outOff, need] = shmLayout(inPlace, inBytes, outBytes);
    try {
      if (this.size < need) {
        let size = this.size || SHM_ALIGN;
        while (size < need) size *= 2;
        this._close();
        await this._create(size);
        if (this.closed) throw new Error('the process group was destroyed');
      }
      if (send) {
        let pos = 0;
        for (const b of send.bufs) { pwriteAll(this.fd, b, pos); pos += b.length; }
      }
      return outOff;
    } catch (e) {
      if (e instanceof ShmRefused) {
        this.disabled = true;
        this.refused = e.message;
      }
      this.end(); // anything else (ENOSPC in /dev/shm, a failed call): frames this time
      return null;
    }
  }

  /** Reads n output bytes at offset into recv (a Segments). */
  get(offset, n, recv) {
    let pos = 0;
    for (const b of recv.bufs) {
      if (pos >= n) break;
      preadAll(this.fd, b.subarray(0, Math.min(b.length, n - pos)), offset + pos);
      pos += b.length;
    }
  }

  /** Ends the collective's use once its call is over (the agent answers only when it has
   * let go of the segment). With discard (the call was cancelled here, so the agent may
   * still use it) the next collective makes a new one; the agent keeps the old memory for
   * as long as it uses it. */
  end(discard = false) {
    if (discard || this.closed) this._close();
    this.inUse = false;
  }

  /** destroy(): a collective still using the segment closes it when it ends. */
  close() {
    this.closed = true;
    if (!this.inUse) this._close();
  }

  _close() {
    const fd = this.fd;
    this.fd = null;
    this.name = null;
    this.size = 0;
    if (fd !== null) fs.closeSync(fd);
  }

  async _create(size) {
    const { fd, name } = await shmCreate(size, this.attach, (resp) => {
      this.slots = Math.max(1, (resp && resp.payload_slots) || 0);
    });
    this.fd = fd;
    this.name = name;
    this.size = size;
  }
}

/** Makes a POSIX segment of size bytes and offers it with attach(name, size, magic), which
 * resolves to the ShmAttachResponse once the agent mapped it; took(resp) sees the answer.
 * Resolves to { fd, name } (the name unlinked already: the agent holds it now). map: it
 * is mapped here instead (the native helper), attach gets the ArrayBuffer too, and the
 * result is { name, ab }, the file closed; with keepFd, open: { name, ab, fd }. */
async function shmCreate(size, attach, took, map = false, keepFd = false) {
  const name = `/paramsync.${process.pid}.${++shmCounter}.${crypto.randomBytes(3)
    .toString('hex')}`;
  const file = `/dev/shm${name}`; // where glibc's shm_open(name) puts it
  const { O_RDWR, O_CREAT, O_EXCL } = fs.constants;
  let fd;
  let ab;
  try {
    fd = fs.openSync(file, O_RDWR | O_CREAT | O_EXCL, 0o600);
  } catch (e) {
    // No usable /dev/shm here: it will not appear later.
    throw new ShmRefused(`open ${file}: ${e.message}`);
  }
  try {
    fs.ftruncateSync(fd, size);
    // Random bytes the agent must read through its own mapping, in this host's
    // byte order (it memcpy's them into a uint64).
    const magic = crypto.randomBytes(8);
    pwriteAll(fd, magic, 0);
    const value = os.endianness() === 'LE' ? magic.readBigUInt64LE(0)
      : magic.readBigUInt64BE(0);
    ab = map ? native.map(fd, size) : null;
    took(await attach(name, size, value.toString(), ab));
    pwriteAll(fd, Buffer.alloc(8), 0);
    if (map && !keepFd) fs.closeSync(fd);
  } catch (e) {
    fs.closeSync(fd);
    throw e;
  } finally {
    // The agent unlinks the name once it maps the segment; so do we, whatever
    // happened, so that nothing is left in /dev/shm.
    try { fs.unlinkSync(file); } catch (e) { /* gone already */ }
  }
  if (map) return keepFd ? { name, ab, fd } : { name, ab };
  return { fd, name };
}

/** Spare segments: a collective in flight beside the one using the World's segment
 * (Promise.all of several) takes one of these instead of gRPC frames, made on demand. Each
 * is a payload segment in a slot of its own at the agent (ShmAttachRequest.slot: spare i
 * in slot i + 1), so one that grows replaces only itself; as many as the agent keeps
 * slots (the first segment's ShmAttachResponse.payload_slots), at most SHM_SPARES. */
class ShmSpares {
  /** attach(name, size, magic, slot), as ShmSegment's. */
  constructor(attach) {
    this.attach = attach;
    this.segs = [];
    this.closed = false;
  }

  /** Resolves to { seg, off } (seg claimed, input written in), or null: gRPC frames.
   * slots: how many the agent keeps; rung: as ShmSegment.begin's. */
  async begin(inPlace, send, recv, slots, rung = false) {
    if (this.closed) return null;
    let seg = this.segs.filter((x) => !x.inUse && !x.disabled)
      .sort((x, y) => y.size - x.size)[0];
    if (!seg) {
      if (this.segs.length >= Math.min(SHM_SPARES, slots - 1)) return null;
      const slot = this.segs.length + 1;
      seg = new ShmSegment((name, size, magic) => this.attach(name, size, magic, slot));
      this.segs.push(seg);
    }
    const off = await seg.begin(inPlace, send, recv, rung); // claims it before any await
    return off === null ? null : { seg, off };
  }

  close() {
    this.closed = true;
    for (const seg of this.segs) seg.close();
  }
}

/** Closes the file an allocation from empty() kept open for peers (none map it after). */
function closeFd(mem) {
  if (mem.fd === null || mem.fd === undefined) return;
  try { fs.closeSync(mem.fd); } catch (e) { /* closed already */ }
  mem.fd = null;
}

/** Memory from empty(): each allocation a segment of its own that the agent keeps
 * (ShmAttach registered, at most 64 per rank) and reads and writes in place. One
 * collective at a time per allocation; a concurrent one copies. */
class Registered {
  constructor(attach, detach) {
    this.attach = attach; // attach(name, size, magic), as a registered segment
    this.detach = detach; // detach(name)
    this.mems = [];
    this.closed = false;
  }

  /** { ab, name, size, inUse, retired, resident, two } of at least nbytes (a page at
   * least); name null for plain memory; resident the agent's --shm-resident-bytes
   * (ShmAttachResponse.resident_bytes), null where it did not say; two: the agent takes a
   * call's output in another allocation than its input (two_segments, header.shm_out). */
  async alloc(nbytes) {
    const size = Math.max(SHM_ALIGN, Math.ceil(nbytes / SHM_ALIGN) * SHM_ALIGN);
    let mem = null;
    if (native && shmEnabled() && !this.closed) {
      try {
        let resident = null;
        let two = false;
        const { name, ab, fd } = await shmCreate(size, this.attach, (resp) => {
          if (resp && resp.resident_told) resident = Number(resp.resident_bytes);
          two = !!(resp && resp.two_segments);
        }, true, size >= PEER.FD_MIN_BYTES && peerMapWanted());
        mem = { ab, name, size, base: native.address(ab), inUse: false, retired: false,
          resident, two, fd: fd === undefined ? null : fd };
      } catch (e) { /* refused or failed: plain memory, as in C */ }
    }
    if (!mem) mem = { ab: new ArrayBuffer(size), name: null, size, inUse: false, retired: false };
    this.mems.push(mem);
    return mem;
  }

  /** Claims the allocation a collective's input and output lie in (one run of bytes each
   * way, apart, or all_reduce's and reduce's one run), or the input's and the output's
   * where the agent takes two (header.shm_out), as arrays of two empty() calls: a segment
   * for them (as ShmSegment's: name, get, end; outName: the output's allocation where it
   * is another) and the input and output offsets; or null. */
  begin(inPlace, send, recv) {
    if (!shmEnabled() || this.closed || !this.mems.some((m) => m.name)) return null;
    const at = placedAt(inPlace, send, recv, false);
    if (!at) return null;
    const holds = (m, a, x) => m.base <= a && a + x.total <= m.base + m.size;
    const free = (a, x) => this.mems.find((m) => m.name && !m.inUse && !m.retired &&
      holds(m, a, x));
    const spans = [[at.in, send], [at.out, recv]].filter(([a]) => a !== null);
    const mems = [free(...spans[0])];
    if (mems[0] && spans.length > 1 && !holds(mems[0], ...spans[1])) {
      const out = free(...spans[1]);
      mems.push(out && mems[0].two && out.two ? out : undefined);
    }
    if (!mems.every(Boolean)) return null;
    mems.forEach((m) => { m.inUse = true; });
    const [mem, outMem] = [mems[0], mems[mems.length - 1]];
    return { seg: { name: mem.name, outName: outMem === mem ? '' : outMem.name, get() {},
      end(discard = false) {
        mems.forEach((m) => {
          m.inUse = false;
          m.retired = m.retired || discard; // the agent may still write into it
        });
      } }, inOff: at.in !== null ? at.in - mem.base : 0,
    outOff: at.out !== null ? at.out - outMem.base : 0 };
  }

  /** Whether every buffer of send and recv (Segments, or null) lies in one allocation
   * from empty() that the agent keeps and would take in place, through its mapping, in a
   * call touching `touched` bytes of its ranks' memory (summed over them): not over its
   * --shm-resident-bytes (the C client's ps__mem_in_place). From two allocations the agent
   * takes them in place too (begin: shm_out), but peer copies measured about as fast
   * there and spare the agent's CPU, so not asked. */
  inPlace(send, recv, touched) {
    const bufs = [send, recv].flatMap((x) => (x ? x.bufs : []));
    const ab = bufs.length ? bufs[0].buffer : null;
    return !!ab && bufs.every((b) => b.buffer === ab) && this.mems.some((m) => m.name &&
      m.ab === ab && (m.resident === null || touched <= m.resident));
  }

  /** Forgets the allocation of ArrayBuffer ab and tells the agent; false when there is
   * none or a collective uses it. */
  async free(ab) {
    const mem = this.mems.find((m) => m.ab === ab);
    if (!mem || mem.inUse) return false;
    this.mems.splice(this.mems.indexOf(mem), 1);
    closeFd(mem);
    if (mem.name) await this.detach(mem.name);
    return true;
  }

  /** The segment whose file this rank keeps open for its peers to map, that ArrayBuffer
   * ab is, as [start, bytes, descriptor]; or null. */
  segmentOf(ab) {
    const mem = this.mems.find((m) => m.ab === ab && m.fd !== null);
    return mem ? [mem.base, mem.size, mem.fd] : null;
  }

  /** The rank left (the agent dropped them): arrays keep their memory. */
  close() {
    this.closed = true;
    this.mems.forEach(closeFd);
    this.mems = [];
  }
}

/*
 * Large collectives from the worker's own buffers (client/shm.c's process segment, as
 * Python's _shm.Process): the agent reads a doorbell request's input from this process's
 * memory and writes the output into it (process_vm_readv/writev, header.shm_process), so
 * nothing is copied through a payload segment. It takes buffers of DIRECT_MIN bytes and
 * more, input and output together, or DIRECT_HUGE_MIN where the kernel gives huge pages
 * on request (collapse()), which the agent's reads pin far faster. PARAMSYNC_SHM_DIRECT=0
 * turns it off, PARAMSYNC_SHM_COLLAPSE=0 the huge pages. Needs the native helper.
 */
const DIRECT_MIN = 32 << 20;
const DIRECT_HUGE_MIN = 8 << 20;
const HUGE_PAGE = 2 << 20;
const EAGAIN = 11;

function directEnabled() { return shmEnabled() && process.env.PARAMSYNC_SHM_DIRECT !== '0'; }
function collapseOff() { return process.env.PARAMSYNC_SHM_COLLAPSE === '0'; }

let collapseWorks = null; // whether the kernel collapses on request, probed once
/** The fewest bytes of buffers a request takes directly. */
function directMin() {
  if (collapseOff()) return DIRECT_MIN;
  if (collapseWorks === null) collapseWorks = native.collapseWorks();
  return collapseWorks ? DIRECT_HUGE_MIN : DIRECT_MIN;
}

// Ranges of whole huge pages taken directly before (the last 64), that the kernel would not
// collapse (the last 16), and refused once with EAGAIN (asked once more).
const collapseSeen = [];
const collapseFailed = [];
const collapseEagain = [];
function remember(list, key, most) {
  list.push(key);
  if (list.length > most) list.shift();
}

/** client/shm.c's collapse(): when a buffer is taken directly for the second time, asks
 * the kernel for huge pages under its whole 2 MiB pages (the contents stay). */
function collapse(b) {
  if (collapseOff()) return;
  const base = native.address(b.buffer) + b.byteOffset;
  const at = Math.ceil(base / HUGE_PAGE) * HUGE_PAGE;
  const end = Math.floor((base + b.length) / HUGE_PAGE) * HUGE_PAGE;
  if (end <= at) return;
  const key = `${at}:${end}`;
  if (!collapseSeen.includes(key)) {
    remember(collapseSeen, key, 64);
    return;
  }
  if (collapseFailed.includes(key)) return;
  const err = native.collapse(b.buffer, b.byteOffset, b.length);
  if (err === 0) return;
  if (err === EAGAIN && !collapseEagain.includes(key)) remember(collapseEagain, key, 16);
  else remember(collapseFailed, key, 16);
}

/** Where a collective's input and output lie in this process (for empty() memory and
 * the direct path): each side one run of bytes (its buffers end to end), or with lists
 * several buffers of one size; no two apart from all_reduce's and reduce's one run
 * overlapping. { in, out } (an address, a list of addresses, or null for no bytes), or
 * null. */
function placedAt(inPlace, send, recv, lists) {
  const spans = [];
  const side = (x) => {
    if (!x || !x.total) return null;
    const at = x.bufs.map((b) => native.address(b.buffer) + b.byteOffset);
    x.bufs.forEach((b, i) => spans.push([at[i], b.length]));
    if (at.every((a, i) => i === 0 || at[i - 1] + x.bufs[i - 1].length === a)) return at[0];
    if (!lists || x.bufs.some((b) => b.length !== x.bufs[0].length)) return undefined;
    return at;
  };
  const i = side(send);
  const o = side(recv);
  if (i === undefined || o === undefined || (i === null && o === null)) return null;
  if (inPlace && typeof i === 'number' && i === o) return { in: i, out: o };
  spans.sort((a, b) => a[0] - b[0]);
  if (spans.some(([a, n], k) => k + 1 < spans.length && a + n > spans[k + 1][0])) return null;
  return { in: i, out: o };
}

class ProcessSegment {
  /** attach(name, size, magic, address) offers it (ShmAttach process): the response. */
  constructor(attach) {
    this.attach = attach;
    this.name = null;
    this.ab = null;
    this.disabled = !native;
    this.making = false;
    this.refused = ''; // why it stays off, once it does
    this.blockLists = false; // the agent takes list forms (header.shm_in_blocks)
    this.used = 0; // collectives that went this way (tests read it)
  }

  /** { in, out } (placedAt's) for a collective the agent may take from and into this
   * process's buffers, the process segment made on first use; null: copy as usual. */
  async begin(inPlace, send, recv) {
    if (this.disabled || this.making || !directEnabled()) return null;
    const ins = send ? send.total : 0;
    const outs = recv ? recv.total : 0;
    const least = directMin();
    if (ins + outs < least) return null;
    const got = placedAt(inPlace, send, recv, true);
    if (!got) return null;
    // On huge pages bytes of buffers, an in-place buffer once; on small pages, as measured
    // when that floor was set, input and output together.
    const once = least === DIRECT_HUGE_MIN && inPlace && got.in === got.out;
    if ((once ? Math.max(ins, outs) : ins + outs) < least) return null;
    if (!this.ab) {
      this.making = true;
      try {
        const made = await shmCreate(SHM_ALIGN, (name, size, magic, ab) =>
          this.attach(name, size, magic, native.address(ab)), (resp) => {
          if (!resp.process_memory) {
            throw new ShmRefused('the agent does not read and write workers\' memory');
          }
          this.blockLists = !!resp.block_lists;
        }, true);
        this.name = made.name;
        this.ab = made.ab;
      } catch (e) { // refused (another PID namespace, ptrace rules) or failed: for good
        this.disabled = true;
        this.refused = e.message;
      } finally {
        this.making = false;
      }
      if (!this.ab) return null;
    }
    if (!this.blockLists && (Array.isArray(got.in) || Array.isArray(got.out))) return null;
    for (const x of [send, recv]) for (const b of x ? x.bufs : []) collapse(b);
    this.used++;
    return got;
  }

  close() {
    this.disabled = true;
    this.ab = null;
  }
}

// ------------------------------------------------------------------ the doorbell

/*
 * Collectives without a call (proto/paramsync/v1/doorbell.h, as the C and Python
 * clients do): when the agent is on this host, a collective goes as its packed header
 * in a small segment of the worker's, a futex wake, and a futex wait for the answer.
 * Input and output that each fit in DB.PAYLOAD bytes go in the doorbell; larger ones in
 * the World's payload segment, whatever their size, when the agent takes such requests
 * (ShmAttachResponse.doorbell_segments). Node can neither map memory nor wait on a futex,
 * so this needs the native helper (client/node/native/paramsync_node.c, built with the
 * daemon); without it, or with PARAMSYNC_SHM=0, every collective is a call. Its wait
 * takes a thread of libuv's pool (4 unless UV_THREADPOOL_SIZE says more) in slices of
 * DB.SLICE_MS, between which a broken job is noticed. Handing the wait to the pool and
 * its end back to the event loop costs tens of microseconds, so where a collective of
 * up to DB.WAIT_NOW_BYTES (input and output) is the only one in flight in the process
 * (one World with doorbells, one of them rung) it first waits on the event loop's own
 * thread, at most waitNowUs() (the loop stops meanwhile, as it does for the payload's
 * copies). Larger ones are seldom answered that soon.
 */
const DB = Object.freeze({ SIZE: 8192, PAYLOAD: 2048, OUT: 2048, CTL: 4096, HEADER: 1024,
  STOPPED: 2, SLICE_MS: 50, MAX: 8, WAIT_NOW_BYTES: 256 << 10 });
// Byte offsets of ps_doorbell_ctl_t's words (doorbell.h): req, resp, closed, header_len,
// header, then code, source, shm and the message.
const DB_REQ = DB.CTL;
const DB_RESP = DB.CTL + 4;
const DB_CLOSED = DB.CTL + 8;
const DB_HLEN = DB.CTL + 12;
const DB_HDR = DB.CTL + 16;
const DB_CODE = DB_HDR + DB.HEADER;
const DB_SOURCE = DB_CODE + 4;
const DB_SHM = DB_CODE + 8;
const DB_MSG = DB_CODE + 12;
const DB_MSG_LEN = 2048;
// Worlds of this process that made a doorbell: waiting on the loop's thread while another
// World's rank (several ranks in one process) has yet to ring would only delay it.
let doorbellWorlds = 0;

/** $PARAMSYNC_NODE_WAIT_NOW_US: how long a lone collective waits for its answer on the
 * event loop's thread before the pool takes the wait (0: at once). */
function waitNowUs() {
  const v = Number(process.env.PARAMSYNC_NODE_WAIT_NOW_US ?? 200);
  return Number.isFinite(v) ? Math.max(0, Math.min(Math.floor(v), 10000)) : 200;
}

/** The native helper, or null (then no doorbell): $PARAMSYNC_NODE_NATIVE names it (0: do
 * without), else the build's (build/client/node, beside this repository's client/node) or
 * one installed next to this file. A helper named but not loadable is an error. */
const native = (() => {
  const named = process.env.PARAMSYNC_NODE_NATIVE;
  if (named === '0') return null;
  if (named) {
    try {
      return require(path.resolve(named));
    } catch (e) {
      throw new Error(`paramsync: cannot load PARAMSYNC_NODE_NATIVE=${named}: ${e.message}`);
    }
  }
  for (const p of [path.join(__dirname, 'paramsync_node.node'),
    path.join(__dirname, '..', '..', 'build', 'client', 'node', 'paramsync_node.node')]) {
    if (fs.existsSync(p)) {
      try { return require(p); } catch (e) { return null; } // another platform's build
    }
  }
  return null;
})();

// CollectiveHeader's wire form, for the doorbell (grpc-js encodes only whole messages).
let headerType = null;
function packHeader(header) {
  if (!headerType) {
    const root = new protobuf.Root();
    const dir = protoDir();
    root.resolvePath = (origin, target) => path.join(dir, target);
    root.loadSync('paramsync/v1/paramsync.proto', { keepCase: true });
    headerType = root.lookupType('paramsync.v1.CollectiveHeader');
  }
  return headerType.encode(headerType.fromObject(header)).finish();
}

class Doorbell {
  /** attach(name, size, magic) offers the segment as a doorbell: the ShmAttachResponse. */
  constructor(attach, group) {
    this.attach = attach;
    this.group = group; // its World's Doorbells
    this.segments = false; // the agent takes requests naming the payload segment
    this.most = 1; // the most doorbells the agent keeps for the rank
    this.ab = null;
    this.name = null;
    this.inUse = false;
    this.disabled = !native;
    this.rung = 0; // requests answered through the doorbell (tests read it)
    this.answeredNow = 0; // of them, answered while waitNow waited
  }

  /** Claims the doorbell, made on first use; false: take a call. claimed: the caller set
   * inUse already (a doorbell just made for it). */
  async begin(claimed = false) {
    if (!claimed) {
      if (this.disabled || this.inUse || !shmEnabled()) return false;
      this.inUse = true;
    }
    if (!this.ab) {
      try {
        const { name, ab } = await shmCreate(DB.SIZE, this.attach, (resp) => {
          this.segments = !!resp.doorbell_segments;
          this.most = Math.max(1, resp.doorbells || 0);
        }, true);
        this.ab = ab;
        this.name = name;
        this.u32 = new Uint32Array(this.ab, DB.CTL, (DB.SIZE - DB.CTL) / 4);
        this.i32 = new Int32Array(this.ab, DB.CTL, (DB.SIZE - DB.CTL) / 4);
        this.bytes = Buffer.from(this.ab);
      } catch (e) { // refused (not this host) or failed: calls from now on
        this.disabled = true;
        this.inUse = false;
        return false;
      }
    }
    if (this._word(DB_CLOSED)) {
      this.disabled = true;
      this.inUse = false;
      return false;
    }
    return true;
  }

  /** The 32-bit word at byte offset off of the control block (doorbell.h), read and
   * written atomically (ordered with the plain stores and loads around them). */
  _word(off) { return Atomics.load(this.u32, (off - DB.CTL) / 4); }

  _setWord(off, v) { Atomics.store(this.u32, (off - DB.CTL) / 4, v); }

  _int(off) { return Atomics.load(this.i32, (off - DB.CTL) / 4); }

  /** Rings for one collective whose header names this doorbell (header.shm and
   * shm_out_offset = DB.OUT, input bufs here) or another segment of the rank (bufs empty:
   * the input is there, or in this process's buffers). Waits for the answer, asking broken() (null, or the error that ends
   * the wait) between slices. direct: the agent reads and writes the caller's own buffers
   * (header.shm_process), so the wait ends unanswered only once it can write no more:
   * broken() should say only that the agent is gone, and a closed doorbell counts once
   * its thread stopped (DB.STOPPED). Resolves to { code, message, source, out } (out:
   * the output in the doorbell, a Buffer, or null), or null when the header does not fit
   * (take a call). The caller calls end(). */
  async run(header, bufs, broken, direct = false, bytes = 0) {
    const packed = packHeader(header);
    if (packed.length > DB.HEADER) return null;
    let pos = 0;
    for (const b of bufs) { b.copy(this.bytes, pos); pos += b.length; }
    this.bytes.set(packed, DB_HDR);
    this._setWord(DB_HLEN, packed.length);
    const req = (this._word(DB_REQ) + 1) >>> 0;
    this._setWord(DB_REQ, req); // after the stores above
    native.wake(this.ab, DB_REQ);
    const now = doorbellWorlds === 1 && this.group.inFlight === 1 &&
      bytes <= DB.WAIT_NOW_BYTES ? waitNowUs() : 0;
    if (now > 0) {
      const r = this._word(DB_RESP);
      if (r !== req && native.waitNow(this.ab, DB_RESP, r, now)) this.answeredNow++;
    }
    for (;;) {
      const r = this._word(DB_RESP);
      if (r === req) break;
      await native.wait(this.ab, DB_RESP, r, DB.SLICE_MS);
      if (this._word(DB_RESP) === req) break;
      const err = broken();
      if (err || (this._word(DB_CLOSED) & (direct ? DB.STOPPED : 0xFFFFFFFF))) {
        this.disabled = true; // abandoned: the agent may still answer into it
        throw err || new ParamsyncError('the agent closed the doorbell (it is stopping)',
          grpc.status.UNAVAILABLE);
      }
    }
    this.rung++;
    const code = this._int(DB_CODE);
    let message = ''; // only an error has one
    if (code) {
      const end = this.bytes.indexOf(0, DB_MSG);
      message = this.bytes.toString('utf8', DB_MSG, end >= 0 && end < DB_MSG + DB_MSG_LEN
        ? end : DB_MSG + DB_MSG_LEN);
    }
    return { code, message, source: this._int(DB_SOURCE),
      out: this._word(DB_SHM) ? this.bytes.subarray(DB.OUT, DB.OUT + DB.PAYLOAD) : null };
  }

  end() { this.inUse = false; }

  /** No more requests (destroy): the mapping goes with the last reference to it. */
  close() {
    this.disabled = true;
    if (!this.inUse) this.ab = this.u32 = this.i32 = this.bytes = null;
  }
}

/** A World's doorbells: a free one for each collective, so that collectives in flight
 * side by side each ring their own; made on demand up to as many as the agent keeps for a
 * rank (ShmAttachResponse.doorbells, at most DB.MAX); past that a collective takes a
 * call. */
class Doorbells {
  constructor(attach) {
    this.attach = attach; // attach(name, size, magic), as a doorbell segment
    this.all = [];
    this.max = 1; // until the first doorbell's answer says
    this.counted = false; // in doorbellWorlds
  }

  get rung() { return this.all.reduce((n, d) => n + d.rung, 0); }

  get answeredNow() { return this.all.reduce((n, d) => n + d.answeredNow, 0); }

  get inFlight() { return this.all.reduce((n, d) => n + (d.inUse ? 1 : 0), 0); }

  /** Resolves to a claimed Doorbell, or null: take a call. The caller calls its end(). */
  async begin() {
    if (!native || !shmEnabled()) return null;
    for (const d of this.all) {
      if (await d.begin()) return d;
    }
    if (this.all.length >= this.max) return null;
    const d = new Doorbell(this.attach, this);
    d.inUse = true; // this caller's: no other claims it while it is made
    this.all.push(d);
    if (!this.counted) {
      this.counted = true;
      doorbellWorlds++;
    }
    if (await d.begin(true)) {
      if (d === this.all[0]) this.max = Math.min(d.most, DB.MAX);
      return d;
    }
    this.max = this.all.length; // refused or failed: no more are made
    return null;
  }

  close() {
    for (const d of this.all) d.close();
    if (this.counted) {
      this.counted = false;
      doorbellWorlds--;
    }
  }
}

// ------------------------------------------------------------------ peer copies

/*
 * Peer copies (client/peer.c's rules and descriptor layout, as Python's _peer.py, so C,
 * Python and Node.js ranks take part together): a large all_to_all, all_gather, gather
 * or scatter whose ranks all share one agent and asked for it at Join copies each block
 * once, rank to rank, with process_vm_readv (the native helper's peerRead): an
 * all_gather of each rank's descriptor (seq s), the reads, then an all_reduce (MAX) of
 * each rank's outcome (seq s + 1), so no rank returns, and none touches its input,
 * before every rank has read; where any could not, the call goes through the agent with
 * seq s + 2 (s + 1 when the descriptors already showed it). Whether a call takes the
 * path is decided alike on every rank from JoinEvent.peer_sets before it takes its
 * sequence numbers. PARAMSYNC_PEER_COPY=0 or PARAMSYNC_SHM=0 keep a rank out.
 */
const PEER = Object.freeze({
  MIN_BYTES: { [KIND.ALL_TO_ALL]: 2 << 20, [KIND.ALL_GATHER]: 4 << 20, [KIND.GATHER]: 8 << 20,
    [KIND.SCATTER]: 4 << 20 },
  MAX_ALL_TO_ALL_RANKS: 64, // all_to_all and scatter: descriptors of n words each
  MAGIC: 0x3270656572737370n,
  // A descriptor's words: magic, PID namespace (device, inode), the nonce's address, the
  // nonce, pid | FITS_*; words 6 to 15 a C rank's CUDA device input or (FITS_SEGMENT) its
  // segment; then the blocks' addresses.
  W_MAGIC: 0, W_PIDNS_DEV: 1, W_PIDNS_INO: 2, W_NONCE_ADDR: 3, W_NONCE: 4, W_PID_FITS: 5,
  W_BLOCKS: 16,
  FITS_HOST: 1n << 32n,
  FITS_DEVICE: 1n << 33n,
  // The input lies whole in an empty() segment whose file the rank keeps open: words 6-8
  // its start, size and descriptor number, for the others to map (pidfd_getfd).
  FITS_SEGMENT: 1n << 34n,
  W_SEG_BASE: 6, W_SEG_SIZE: 7, W_SEG_FD: 8,
  FD_MIN_BYTES: 1 << 20, // empty() allocations that keep their file open (client/shm.c)
  SEQS: 3, // sequence numbers a call that takes the path holds
});

/** Whether ranks map each other's empty() segments (PARAMSYNC_PEER_MAP=0: they read them
 * with process_vm_readv, as client/peer.c). */
function peerMapWanted() {
  return !!native && !!native.peerMapRead && process.env.PARAMSYNC_PEER_MAP !== '0';
}

// Bytes of an element, by DTYPES value: the typed array each dtype travels in.
const ELEMENT_BYTES = DTYPE_NAMES.map((n) => ALLOWED[n][0].BYTES_PER_ELEMENT);

/** This process to its peers, read once: its PID namespace, and a random number at a
 * fixed address that peers read, in the same system call as a block, to know they read
 * this process. */
class PeerSelf {
  constructor() {
    try {
      const st = fs.statSync('/proc/self/ns/pid', { bigint: true });
      this.pidnsDev = st.dev;
      this.pidnsIno = st.ino;
    } catch (e) {
      this.pidnsDev = this.pidnsIno = 0n;
    }
    this.cell = new ArrayBuffer(8);
    this.nonce = crypto.randomBytes(8).readBigUInt64LE(0);
    new BigUint64Array(this.cell)[0] = this.nonce;
    this.nonceAddress = native ? native.address(this.cell) : 0;
  }

  /** Whether to ask for peer copies at Join: not without the native helper, with
   * PARAMSYNC_PEER_COPY=0 or PARAMSYNC_SHM=0, nor under Yama ptrace_scope 1 or more (a
   * process may then read only its descendants). */
  wanted() {
    if (!native || process.env.PARAMSYNC_PEER_COPY === '0' || !shmEnabled() || !this.pidnsIno) {
      return false;
    }
    let scope = 0;
    try {
      scope = Number(fs.readFileSync('/proc/sys/kernel/yama/ptrace_scope', 'utf8').trim());
    } catch (e) {
      scope = e.code === 'ENOENT' ? 0 : 1;
    }
    return scope === 0;
  }

  /** This rank's descriptor: ins the addresses of its input's blocks (an all_to_all's or
   * scatter root's n, an all_gather's or gather's one); fits: its buffers suit; seg:
   * [start, bytes, descriptor] of the empty() segment its input lies in whole, kept open
   * for the others to map, or null. */
  describe(ins, fits, seg = null) {
    const w = new BigUint64Array(PEER.W_BLOCKS + ins.length);
    w.set([PEER.MAGIC, this.pidnsDev, this.pidnsIno, BigInt(this.nonceAddress), this.nonce,
      BigInt(process.pid & 0xFFFFFFFF) | (fits ? PEER.FITS_HOST : 0n)]);
    if (fits && seg) {
      w[PEER.W_PID_FITS] |= PEER.FITS_SEGMENT;
      w.set(seg.map(BigInt), PEER.W_SEG_BASE);
    }
    ins.forEach((a, i) => { w[PEER.W_BLOCKS + i] = BigInt(a); });
    return w;
  }
}

function blocksPerRank(kind) { return kind === KIND.ALL_TO_ALL || kind === KIND.SCATTER; }

/** Whether a call takes peer copies: its blocks (block bytes, one per rank of its group)
 * are enough bytes, and every rank of the group (job ranks groupRanks) is in this rank's
 * (job rank) peer-copy set. */
// ------------------------------------------------------------------ direct barriers

// Barriers of ranks on one agent met on a page of shared memory they all map, without the
// agent: the C client's layout and steps (client/barrier.c), so C, Python and Node.js ranks
// meet on one page. The first two such barriers of a group set it up through the agent
// (an all_gather of rank 0's name for it, an all_reduce MIN of whether each rank mapped
// it); from the third on a rank raises its word of arrived[] to the barrier's sequence number
// + 1, reads the others', and the
// one that finds all there raises gen and wakes the others (a futex on gen). The arrivals
// say a barrier is met; gen only wakes. other[] holds one more than the number of each
// rank's last other call: a rank whose word is m called another collective where the
// others called direct barrier m, and a waiter that sees it takes its barrier to the agent,
// where the hub fails both sides at once.
const BAR = { PAGE: 4096, NAME: 64, ARRIVED: 16, SLICE_MS: 50 }; // ARRIVED: in words
BAR.MAX_RANKS = (BAR.PAGE / 4 - BAR.ARRIVED) / 2; // two words a rank
BAR.OTHER = BAR.ARRIVED + BAR.MAX_RANKS;
const MEET = { PENDING: 0, MET: 1, MISMATCH: 2, TIMEOUT: 3 };

/** JoinRequest.direct_barrier (asked along with peer copies): with the native helper (its
 * futexes), not with PARAMSYNC_DIRECT_BARRIER=0 nor PARAMSYNC_SHM=0. */
function barrierWanted() {
  return !!native && process.env.PARAMSYNC_DIRECT_BARRIER !== '0' && shmEnabled();
}

/** Whether a barrier of the group `groupRanks` may meet directly: every rank has the
 * caller's nonzero number in the barrier sets. Alike on every rank of the group. */
function barrierTakes(sets, groupRanks, rank) {
  if (!sets || groupRanks.length > BAR.MAX_RANKS) return false;
  const mine = sets[rank];
  return mine !== 0 && groupRanks.every((r) => sets[r] === mine);
}

/** a < m, as 32-bit counters that wrap. */
function behind(a, m) { return ((a - m) >>> 0) >= 0x80000000; }

/** One group's direct barriers: the calls counted, the setup's two steps (promises that
 * settle when each ended here), and the page (once step 2 has ended, null means through
 * the agent). */
class BarrierPage {
  constructor() {
    this.calls = 0;
    this.steps = [null, null];
    this.ab = null;
    this.u32 = null;
    this.name = null; // rank 0's name of the page until it unlinks it
    this.metNow = 0; // barriers met while the loop's thread waited (tests read it)
  }

  _map(fd) {
    if (fs.fstatSync(fd).size !== BAR.PAGE) throw new Error('the barrier page has the wrong size');
    this.ab = native.map(fd, BAR.PAGE);
    this.u32 = new Uint32Array(this.ab);
  }

  /** Group rank 0: makes the page; its name as BAR.NAME bytes (zeros when it cannot). */
  make() {
    const name = `/paramsync.${process.pid}.bar.${++shmCounter}.${crypto.randomBytes(3)
      .toString('hex')}`;
    const { O_RDWR, O_CREAT, O_EXCL } = fs.constants;
    const out = Buffer.alloc(BAR.NAME);
    let fd;
    try {
      fd = fs.openSync(`/dev/shm${name}`, O_RDWR | O_CREAT | O_EXCL, 0o600);
    } catch (e) {
      return out;
    }
    this.name = name;
    try {
      fs.ftruncateSync(fd, BAR.PAGE);
      this._map(fd);
      out.write(name);
    } catch (e) {
      this.ab = null;
      this.unlink();
    } finally {
      fs.closeSync(fd);
    }
    return out;
  }

  /** The other ranks: maps the page rank 0 named (nothing when it named none). */
  open(record) {
    const end = record.indexOf(0);
    const name = record.subarray(0, end < 0 ? record.length : end).toString();
    if (!name.startsWith('/paramsync.')) return;
    let fd;
    try {
      fd = fs.openSync(`/dev/shm${name}`, fs.constants.O_RDWR);
    } catch (e) {
      return;
    }
    try {
      this._map(fd);
    } catch (e) {
      this.ab = null;
      this.u32 = null;
    } finally {
      fs.closeSync(fd);
    }
  }

  unlink() {
    if (this.name) {
      try { fs.unlinkSync(`/dev/shm${this.name}`); } catch (e) { /* gone already */ }
    }
    this.name = null;
  }

  /** Unmapped when the buffer is collected. */
  close() {
    this.unlink();
    this.ab = null;
    this.u32 = null;
  }

  /** Raises word i of the page u32 to at least v. */
  static raise(u32, i, v) {
    let cur = Atomics.load(u32, i);
    while (behind(cur, v)) {
      const was = Atomics.compareExchange(u32, i, cur, v);
      if (was === cur) return;
      cur = was;
    }
  }

  /** Once a call other than a direct barrier has its (first) sequence number: says so on
   * the page (other[]), once there is one. A peer copy's first number is its all_gather of
   * addresses through the agent. */
  started(me, seq) {
    if (this.u32) Atomics.store(this.u32, BAR.OTHER + me, (seq + 1) >>> 0);
  }

  /** On the page u32: MEET.MET when all n ranks called direct barrier m, MEET.MISMATCH
   * when one called another collective under its number, else MEET.PENDING. */
  static arrivals(u32, n, m) {
    let got = MEET.MET;
    for (let i = 0; i < n; i++) {
      if (Atomics.load(u32, BAR.OTHER + i) === m) return MEET.MISMATCH;
      if (behind(Atomics.load(u32, BAR.ARRIVED + i), m)) got = MEET.PENDING;
    }
    return got;
  }

  missing(ranks, m) {
    return ranks.filter((r, i) => behind(Atomics.load(this.u32, BAR.ARRIVED + i), m) ||
      Atomics.load(this.u32, BAR.OTHER + i) === m);
  }

  /** Direct barrier m (its sequence number + 1): resolves to MEET.MET once all n ranks
   * called it, MEET.MISMATCH when one called another collective under its number (the
   * barrier is then to go to the agent), MEET.TIMEOUT at the deadline (Date.now()); rejects
   * with broken()'s error. The page stays mapped for it while it waits, even if the World
   * is destroyed meanwhile (broken() then says so). */
  async meet(me, n, m, deadline, broken, nowUs = 0) {
    const { u32, ab } = this;
    BarrierPage.raise(u32, BAR.ARRIVED + me, m);
    let got = BarrierPage.arrivals(u32, n, m);
    if (got !== MEET.PENDING) {
      if (got === MEET.MET) BarrierPage.raise(u32, 0, m);
      native.wake(ab, 0);
      return got;
    }
    // Alone in flight: first on the loop's own thread, as the doorbell does.
    if (nowUs > 0 && native.waitNow(ab, 0, Atomics.load(u32, 0), nowUs) &&
      BarrierPage.arrivals(u32, n, m) === MEET.MET) {
      this.metNow++;
      return MEET.MET;
    }
    for (;;) {
      const seen = Atomics.load(u32, 0);
      got = BarrierPage.arrivals(u32, n, m);
      if (got === MEET.MISMATCH) {
        native.wake(ab, 0); // the others waiting see it now, not a slice later
        return got;
      }
      if (!behind(seen, m) || got === MEET.MET) return MEET.MET;
      const err = broken();
      if (err) throw err;
      const left = deadline - Date.now();
      if (left <= 0) return MEET.TIMEOUT;
      await native.wait(ab, 0, seen, Math.max(1, Math.min(BAR.SLICE_MS, left)));
    }
  }
}

function peerTakes(kind, block, sets, groupRanks, rank) {
  const n = groupRanks.length;
  if (!PEER.MIN_BYTES[kind] || !sets || n < 2 || block * n < PEER.MIN_BYTES[kind]) return false;
  if (blocksPerRank(kind) && n > PEER.MAX_ALL_TO_ALL_RANKS) return false;
  return oneSet(sets, groupRanks, rank);
}

/** Whether every rank of the group (job ranks groupRanks) is in this rank's (job rank
 * `rank`) peer-copy set, so that its calls may go rank to rank. */
function oneSet(sets, groupRanks, rank) {
  const mine = sets ? sets[rank] : 0;
  return !!mine && groupRanks.every((r) => sets[r] === mine);
}

/** The bytes of its ranks' memory an agent taking the call would touch, summed over them,
 * as it counts them against --shm-resident-bytes (client/peer.c). */
function agentTouches(kind, n, block) {
  if (kind === KIND.ALL_TO_ALL) return 2 * n * n * block;
  if (kind === KIND.ALL_GATHER) return n * block + n * n * block;
  return 2 * n * block; // gather, scatter: every rank's block, and the root's n
}

/** Each of the n blocks of block bytes of segs as [buffer, offset in it], or null where a
 * block spans two buffers. */
function peerBlocks(segs, n, block) {
  const out = [];
  let i = 0;
  for (let j = 0; j < n; j++) {
    const at = j * block;
    while (i + 1 < segs.starts.length && segs.starts[i + 1] <= at) i++;
    const off = at - segs.starts[i];
    if (off + block > segs.bufs[i].length) return null;
    out.push([segs.bufs[i], off]);
  }
  return out;
}

/** Every rank's descriptor (n of words words each in d), or null when one may not be read
 * (not suited, another PID namespace, a device input). */
function peerAllFit(d, n, words) {
  for (let i = 0; i < n; i++) {
    const x = d.subarray(i * words, (i + 1) * words);
    const fits = x[PEER.W_PID_FITS];
    if (x[PEER.W_MAGIC] !== PEER.MAGIC || !(fits & PEER.FITS_HOST) ||
        (fits & PEER.FITS_DEVICE) || !(fits & 0xFFFFFFFFn) || !x[PEER.W_PIDNS_INO] ||
        x[PEER.W_PIDNS_DEV] !== d[PEER.W_PIDNS_DEV] ||
        x[PEER.W_PIDNS_INO] !== d[PEER.W_PIDNS_INO]) return null;
  }
  return d;
}

/** Reads this rank's blocks from the others into outs ([buffer, offset] of its output's
 * blocks) and copies its own from ins: true, or false if any could not be read whole from
 * the process that holds its rank's nonce. block: the bytes of every block, or an array of
 * the bytes this rank takes from each rank (an uneven allToAllSingle's pairs, its own
 * block's too). mapped: through mappings of the segments that ranks offer
 * (peerMapWanted). */
function peerPull(kind, n, rank, root, d, words, block, outs, ins, mapped) {
  const which = blocksPerRank(kind) ? rank : 0;
  const sizes = Array.isArray(block) ? block : new Array(n).fill(block);
  const read = (i, [buf, off]) => {
    if (!sizes[i]) return true;
    const x = d.subarray(i * words, (i + 1) * words);
    const args = [Number(x[PEER.W_PID_FITS] & 0xFFFFFFFFn), Number(x[PEER.W_NONCE_ADDR]),
      x[PEER.W_NONCE], Number(x[PEER.W_BLOCKS + which]), sizes[i], buf.buffer,
      buf.byteOffset + off];
    // Through a mapping of the owner's segment where it offers one, kept for later calls;
    // else (or failing that) process_vm_readv, which pins the pages one by one each call.
    return (mapped && (x[PEER.W_PID_FITS] & PEER.FITS_SEGMENT) !== 0n &&
      native.peerMapRead(...args, Number(x[PEER.W_SEG_FD]), Number(x[PEER.W_SEG_BASE]),
        Number(x[PEER.W_SEG_SIZE]))) || native.peerRead(...args);
  };
  if (kind === KIND.SCATTER && rank !== root) return read(root, outs[0]);
  if (kind === KIND.GATHER && rank !== root) return true; // it only lends its input
  for (let k = 1; k < (kind !== KIND.SCATTER ? n : 1); k++) {
    const i = (rank + k) % n; // not every rank at rank 0 first
    if (!read(i, outs[i])) return false;
  }
  const [tb, to] = kind === KIND.SCATTER ? outs[0] : outs[rank];
  const [fb, from] = ins[which];
  if (sizes[rank] && (tb.buffer !== fb.buffer || tb.byteOffset + to !== fb.byteOffset + from)) {
    fb.copy(tb, to, from, from + sizes[rank]);
  }
  return true;
}

// ------------------------------------------------------------------ groups

const WORLD = Object.freeze({ toString: () => 'GroupMember.WORLD' });
const NON_GROUP_MEMBER = Object.freeze({ toString: () => 'GroupMember.NON_GROUP_MEMBER' });
const GroupMember = Object.freeze({ WORLD, NON_GROUP_MEMBER });

class ProcessGroup {
  constructor(world, id, ranks, rank) {
    this.world = world;
    this.id = id;
    this.ranks = ranks.slice();
    this._rank = rank;
    this._seq = 0;
    this._sendSeq = new Map();
    this._recvSeq = 0;
    this._bar = new BarrierPage(); // its direct barriers
    world.barPages.push(this._bar);
  }

  rank() { return this._rank; }

  size() { return this.ranks.length; }
}

// ------------------------------------------------------------------ init

function envInt(name) {
  const v = process.env[name];
  if (v === undefined || v === '') return undefined;
  if (!/^-?\d+$/.test(v)) throw new RangeError(`$${name} must be an integer, not ${v}`);
  return Number(v);
}

function sleep(ms) { return new Promise((r) => setTimeout(r, ms)); }

async function waitForFile(file, timeoutMs) {
  const end = Date.now() + timeoutMs;
  for (;;) {
    try {
      const text = fs.readFileSync(file, 'utf8');
      if (text.trim() && text.endsWith('\n')) return text.trim().split('\n')[0].trim();
    } catch (e) {
      if (e.code !== 'ENOENT') throw e;
    }
    if (Date.now() >= end) {
      throw new ParamsyncError(`initProcessGroup: ${file} holds no daemon address after ` +
        `${timeoutMs} ms (start paramsyncd --announce-file ${file})`,
      grpc.status.DEADLINE_EXCEEDED);
    }
    await sleep(50);
  }
}

/** { addr, job, worldSize, rank } from the init method and the environment (Python's rules). */
async function resolve(opts, joinTimeoutMs) {
  const url = opts.initMethod || 'env://';
  const m = /^([a-z]+):(\/\/)?([^?]*)(\?(.*))?$/.exec(url);
  if (!m) throw new RangeError(`unsupported initMethod ${url}`);
  const scheme = m[1];
  const rest = m[3];
  const query = Object.fromEntries(new URLSearchParams(m[5] || ''));
  let job = query.job || opts.groupName || process.env.PARAMSYNC_JOB || undefined;
  let addr;
  if (scheme === 'env') {
    addr = process.env.PARAMSYNC_ADDR;
    if (!addr) {
      const host = process.env.MASTER_ADDR; const port = process.env.MASTER_PORT;
      if (!host || !port) {
        throw new RangeError('env:// init: set PARAMSYNC_ADDR (the daemon\'s HOST:PORT), or ' +
          'MASTER_ADDR and MASTER_PORT');
      }
      addr = `${host}:${port}`;
    }
  } else if (scheme === 'tcp') {
    if (!/^(\[[^\]]+\]|[^:/]+):\d+$/.test(rest)) {
      throw new RangeError(`tcp:// init method needs tcp://HOST:PORT, got ${url}`);
    }
    addr = rest;
  } else if (scheme === 'unix') {
    addr = `unix:${decodeURIComponent(rest)}`;
  } else if (scheme === 'file') {
    const file = decodeURIComponent(rest);
    if (!file) throw new RangeError(`file:// init method needs file:///PATH, got ${url}`);
    addr = await waitForFile(file, joinTimeoutMs);
    job = job || file;
  } else {
    throw new RangeError(`unsupported initMethod ${url} (env://, tcp://HOST:PORT, ` +
      'file:///PATH, unix:PATH)');
  }
  let worldSize = opts.worldSize !== undefined && opts.worldSize >= 0 ? opts.worldSize
    : query.world_size !== undefined ? Number(query.world_size) : envInt('WORLD_SIZE');
  if (worldSize === undefined) {
    throw new RangeError('worldSize is not known: pass { worldSize } or set $WORLD_SIZE');
  }
  if (!Number.isInteger(worldSize) || worldSize < 1) {
    throw new RangeError(`worldSize must be a positive integer, got ${worldSize}`);
  }
  let rank = opts.rank !== undefined && opts.rank >= 0 ? opts.rank
    : query.rank !== undefined ? Number(query.rank) : envInt('RANK');
  if (rank === undefined) rank = -1;
  if (rank >= worldSize) throw new RangeError(`rank ${rank} is outside a world of ${worldSize}`);
  return { addr, job: job || 'default', worldSize, rank };
}

function credentials() {
  const ca = process.env.PARAMSYNC_TLS_CA;
  if (!ca) return { creds: grpc.credentials.createInsecure(), options: {} };
  const read = (p) => (p ? fs.readFileSync(p) : null);
  const options = {};
  if (process.env.PARAMSYNC_TLS_SERVER_NAME) {
    options['grpc.ssl_target_name_override'] = process.env.PARAMSYNC_TLS_SERVER_NAME;
  }
  return { creds: grpc.credentials.createSsl(read(ca), read(process.env.PARAMSYNC_TLS_KEY),
    read(process.env.PARAMSYNC_TLS_CERT)), options };
}

function chunkBytes() {
  const v = Number(process.env.PARAMSYNC_CHUNK_BYTES || 1 << 20);
  return Math.max(1, Math.min(Number.isFinite(v) ? v : 1 << 20, 4 << 20));
}

// ------------------------------------------------------------------ a member of a job

/**
 * One rank of one job. init() joins; the methods are the collectives. The
 * module-level functions act on the default World made by initProcessGroup;
 * several Worlds may live in one process (e.g. to run many ranks in a test).
 */
class World {
  /**
   * opts: { initMethod, worldSize, rank, timeout (ms), groupName } as
   * initProcessGroup's. Resolves to the World once all ranks have joined.
   */
  static async init(opts = {}) {
    const w = new World();
    await w._init(opts);
    return w;
  }

  async _init(opts) {
    let timeoutMs = opts.timeout !== undefined ? Number(opts.timeout)
      : envInt('PARAMSYNC_TIMEOUT_MS') || 30 * 60 * 1000;
    const joinMs = opts.timeout !== undefined ? timeoutMs
      : envInt('PARAMSYNC_JOIN_TIMEOUT_MS') || timeoutMs;
    if (!(timeoutMs > 0) || !(joinMs > 0)) throw new RangeError('timeout must be positive');
    const scratchMax = envInt('PARAMSYNC_SCRATCH_BYTES') ?? SCRATCH.BYTES;
    if (scratchMax < 0) {
      throw new RangeError(`$PARAMSYNC_SCRATCH_BYTES must be a number of bytes, not ${scratchMax}`);
    }
    timeoutMs = Math.min(timeoutMs, 0xFFFFFFFF);
    const r = await resolve(opts, joinMs);
    this.addr = r.addr;
    this.job = r.job;
    this.timeoutMs = timeoutMs;
    const { creds, options } = credentials();
    this.client = new pb.Worker(r.addr, creds, { ...options,
      'grpc.max_receive_message_length': -1, 'grpc.max_send_message_length': -1 });
    this.md = new grpc.Metadata();
    if (process.env.PARAMSYNC_TOKEN) {
      this.md.set('authorization', `Bearer ${process.env.PARAMSYNC_TOKEN}`);
    }
    this.failure = null;
    this.inflight = new Set();
    this.scratchFree = []; // padded blocks of uneven allToAllSingle calls, kept (_scratch)
    this.scratchMem = []; // the same on memory of empty() (_scratch with registered)
    this.scratchMax = scratchMax; // the largest kept ($PARAMSYNC_SCRATCH_BYTES)
    this.shm = new ShmSegment((name, size, magic) => this._shmAttach(name, size, magic));
    this.spares = new ShmSpares((name, size, magic, slot) => this._shmAttach(name, size, magic,
      { slot }));
    this.doorbells = new Doorbells((name, size, magic) => this._shmAttach(name, size, magic,
      { doorbell: true }));
    // Memory from empty(): segments of their own, used in place.
    this.mem = new Registered((name, size, magic) => this._shmAttach(name, size, magic,
      { registered: true }), (name) => this._shmDetach(name));
    // Large collectives read and written by the agent in this process's own buffers.
    this.proc = new ProcessSegment((name, size, magic, address) => this._shmAttach(name, size,
      magic, { proc: true, address }));
    this.joinGone = false; // the membership stream to the agent ended
    this.peerSelf = new PeerSelf();
    this.peerSets = null; // JoinEvent.peer_sets: one per job rank
    this.barrierSets = null; // JoinEvent.barrier_sets (direct barriers)
    this.barPages = []; // every group's BarrierPage, closed with the World
    this.barWaiting = 0; // direct barriers waiting now
    this.peerUsed = 0; // collectives that went by peer copies (tests read it)
    this.leaving = false;
    this.nNewGroups = 0;
    try {
      await this._join(r.worldSize, r.rank, joinMs);
    } catch (e) {
      this.client.close();
      throw e;
    }
  }

  _join(worldSize, rank, joinMs) {
    return new Promise((resolveJoin, rejectJoin) => {
      let ready = false;
      let settled = false;
      const settle = (fn, v) => { if (!settled) { settled = true; clearTimeout(timer); fn(v); } };
      const timer = setTimeout(() => {
        if (this.joinCall) this.joinCall.cancel();
        settle(rejectJoin, new ParamsyncError(`initProcessGroup: no answer from the daemon ` +
          `at ${this.addr} within ${joinMs} ms (job ${this.job})`,
        grpc.status.DEADLINE_EXCEEDED));
      }, joinMs + 10000);
      this.client.waitForReady(Date.now() + joinMs, (err) => {
        if (err) {
          settle(rejectJoin, new ParamsyncError(`initProcessGroup: cannot reach the daemon at ` +
            `${this.addr}: ${err.message}`, grpc.status.UNAVAILABLE));
          return;
        }
        const call = this.client.Join(this.md);
        this.joinCall = call;
        call.on('data', (ev) => {
          if (!ready) {
            ready = true;
            if (ev.kind !== JOIN.READY) {
              call.cancel();
              settle(rejectJoin, new ParamsyncError(`initProcessGroup: job ${this.job}: ` +
                `event ${ev.kind} ${ev.message}`, grpc.status.ABORTED, ev.message));
              return;
            }
            if (ev.world_size !== worldSize) {
              call.cancel();
              settle(rejectJoin, new ParamsyncError(`initProcessGroup: the daemon says world ` +
                `size ${ev.world_size}, not ${worldSize}`, grpc.status.INTERNAL));
              return;
            }
            this.rank = ev.rank;
            this.size = ev.world_size;
            // As a Long made once (headers carry it): protobufjs would parse the string
            // on every encode.
            this.incarnation = protobuf.util.Long
              ? protobuf.util.Long.fromString(String(ev.incarnation), true) : ev.incarnation;
            this.barrierSets = ev.barrier_sets && ev.barrier_sets.length === ev.world_size
              ? ev.barrier_sets.map(Number) : null;
            this.peerSets = ev.peer_sets && ev.peer_sets.length === ev.world_size
              ? ev.peer_sets.map(Number) : null;
            this.worldGroup = new ProcessGroup(this, 0, [...Array(this.size).keys()], this.rank);
            settle(resolveJoin);
            return;
          }
          if (ev.kind === JOIN.MEMBER_LOST) {
            // The coordinator's message names the job, the rank and why.
            this._fail(new ParamsyncError(ev.message || `rank ${ev.rank} of job ${this.job} ` +
              'was lost (it died or its connection broke)', grpc.status.ABORTED));
          } else if (ev.kind === JOIN.JOB_ABORTED) {
            this._fail(new ParamsyncError(`job ${this.job} was aborted: ${ev.message}`,
              grpc.status.ABORTED, ev.message));
          }
        });
        call.on('error', (e) => {
          this.joinGone = true;
          const details = e.details || e.message;
          if (!ready) {
            settle(rejectJoin, makeError(`initProcessGroup (job ${this.job} at ${this.addr})`,
              e.code, details));
          } else if (!this.leaving) {
            this._fail(makeError(`the connection to the agent at ${this.addr} broke (the ` +
              `membership of job ${this.job})`, e.code, details + keepaliveHint(details)));
          }
        });
        call.on('end', () => {
          this.joinGone = true;
          if (!ready) {
            settle(rejectJoin, new ParamsyncError('initProcessGroup: the daemon closed the ' +
              'membership stream', grpc.status.UNAVAILABLE));
          } else if (!this.leaving) {
            this._fail(new ParamsyncError(`the daemon ended the membership of job ${this.job}`,
              grpc.status.UNAVAILABLE));
          }
        });
        this.joinEnded = new Promise((res) => call.on('close', res).on('status', res));
        const peerCopies = this.peerSelf.wanted();
        call.write({ job: this.job, world_size: worldSize, rank,
          timeout_ms: Math.min(joinMs, 0xFFFFFFFF), peer_copies: peerCopies,
          pid_namespace: peerCopies ? String(this.peerSelf.pidnsIno) : '0',
          direct_barrier: peerCopies && barrierWanted() });
        // The sending side stays open: that is the membership.
      });
    });
  }

  /** Offers a segment to the agent (Worker.ShmAttach); rejects with ShmRefused when it
   * will never map ours (it said so, or it lacks or cannot serve the method). */
  _shmAttach(name, size, magic, { slot = 0, doorbell = false, registered = false,
    proc = false, address = 0 } = {}) {
    return new Promise((res, rej) => {
      this.client.ShmAttach({ job: this.job, rank: this.rank, name, size: String(size), magic,
        slot, doorbell, registered, process: proc, pid: proc ? process.pid : 0,
        address: String(address) }, this.md, { deadline: Date.now() + 10000 }, (err, resp) => {
          if (err) {
            const never = err.code === grpc.status.UNIMPLEMENTED ||
              err.code === grpc.status.UNAVAILABLE;
            rej(never ? new ShmRefused(`ShmAttach: ${STATUS_NAMES[err.code]}: ${err.details}`)
              : err);
          } else if (!resp.attached) {
            rej(new ShmRefused(resp.reason || 'the agent did not attach the segment'));
          } else {
            res(resp);
          }
        });
    });
  }

  /** Tells the agent to drop a registered segment (best effort: it drops them all when
   * the rank leaves). */
  _shmDetach(name) {
    return new Promise((res) => {
      this.client.ShmDetach({ job: this.job, rank: this.rank, name }, this.md,
        { deadline: Date.now() + 10000 }, () => res());
    });
  }

  /** A typed array of count elements of dtype (a name, as in DTYPES) whose memory the
   * agent reads and writes in place (the C client's ps_mem_alloc, Python's empty()): a
   * collective whose input and output lie in one such array takes no copy here. A
   * segment of its own, at most 64 per rank; without the native helper, past that limit,
   * or when the agent cannot map it, plain memory that collectives copy as usual. Zeroed.
   * float16 and bfloat16 come as a Uint16Array, bool as a Uint8Array. */
  async empty(count, dtype = 'float32') {
    this._check();
    const name = typeof dtype === 'number' ? DTYPE_NAMES[dtype] : String(dtype);
    const Kind = ALLOWED[name] && ALLOWED[name][0];
    if (!Kind) {
      throw new TypeError(`empty: unknown dtype ${JSON.stringify(dtype)} (one of ` +
        `${DTYPE_NAMES.join(', ')})`);
    }
    if (!Number.isSafeInteger(count) || count < 0) {
      throw new RangeError(`empty: count must be a non-negative integer, not ${count}`);
    }
    const mem = await this.mem.alloc(count * Kind.BYTES_PER_ELEMENT);
    return new Kind(mem.ab, 0, count);
  }

  /** Gives an array from empty() back (it stays usable, as plain memory, while it
   * lives). RangeError for one not from empty() or that a collective still uses. */
  async free(tensor) {
    if (!isTensor(tensor) || !(await this.mem.free(tensor.buffer))) {
      throw new RangeError('free: not an array from empty(), or a collective still uses it');
    }
  }

  _fail(err) {
    if (!this.failure) this.failure = err;
    for (const c of this.inflight) c.cancel();
  }

  _check() {
    if (this.closed) throw new Error('the process group was destroyed');
    if (this.failure) {
      throw new ParamsyncError(this.failure.message, this.failure.code, this.failure.details);
    }
  }

  /** Leaves the job gracefully (Leave, then half-close) and closes the channel. */
  async destroy() {
    if (this.leaving) return;
    this.leaving = true;
    try {
      if (this.joinCall) { // also after a failure: this process is alive, and says so
        await new Promise((res) => {
          this.client.Leave({ job: this.job, rank: this.rank }, this.md,
            { deadline: Date.now() + 10000 }, () => res());
        });
        this.joinCall.end();
        let timer;
        await Promise.race([this.joinEnded, new Promise((res) => { timer = setTimeout(res, 10000); })]);
        clearTimeout(timer);
      }
    } finally {
      this._close();
      this.client.close();
    }
  }

  /** Breaks the membership stream without Leave: the others hear MEMBER_LOST. */
  abort() {
    this.leaving = true;
    this._close();
    if (this.joinCall) this.joinCall.cancel();
    this.client.close();
  }

  /** No more collectives: every segment and doorbell of this rank let go. */
  _close() {
    this.closed = true;
    for (const x of [this.shm, this.spares, this.doorbells, this.mem, this.proc]) x.close();
    for (const b of this.barPages) b.close();
    // Other ranks' segments mapped here (the process's table: a World still in use maps
    // again what it reads next).
    if (peerMapWanted()) native.peerMapSweep(-1);
  }

  // -------------------------------------------------------------- collectives engine

  /** Why no answer will come any more (the membership failed, this rank left), or null. */
  _broken() {
    if (this.failure) {
      return new ParamsyncError(this.failure.message, this.failure.code, this.failure.details);
    }
    if (this.leaving || this.closed) {
      return new ParamsyncError('the process group was destroyed', grpc.status.CANCELLED);
    }
    return null;
  }

  /** Why the agent can no longer answer (nor write into this process): the membership
   * stream to it ended, or this rank left; else null. */
  _gone() {
    if (this.joinGone || this.leaving || this.closed) {
      return new ParamsyncError('lost the membership stream to the agent',
        grpc.status.UNAVAILABLE);
    }
    return null;
  }

  /** Requests answered through the doorbells (tests read it). */
  get doorbellRung() { return this.doorbells.rung; }

  /** Of them, those answered while the event loop's thread waited (waitNowUs). */
  get doorbellAnsweredNow() { return this.doorbells.answeredNow; }

  /** Barriers met on the ranks' shared page while the loop's thread waited. */
  get barrierMetNow() { return this.barPages.reduce((n, b) => n + b.metNow, 0); }

  /** Rings doorbell d for a collective: its input and output in the doorbell (seg null),
   * or at inOff and outOff of seg (the payload segment, its input written there, memory
   * from empty(), or with seg.direct addresses in this process). Ends seg (discarded if
   * the request was abandoned: the agent may still use it); the caller ends d. Resolves
   * to the result, or null when the header does not fit (nothing was rung; seg stays
   * claimed for a call). */
  async _ring(d, header, send, recv, seg, inOff, outOff, what) {
    let abandoned = false;
    let got = null;
    const direct = !!(seg && seg.direct);
    try {
      header.shm = seg ? seg.name : d.name;
      header.shm_out = (seg && seg.outName) || '';
      // Direct: addresses in this process, a list for a side of several buffers.
      header.shm_process = direct;
      header.shm_in_blocks = Array.isArray(inOff) ? inOff.map(String) : [];
      header.shm_out_blocks = Array.isArray(outOff) ? outOff.map(String) : [];
      header.shm_in_offset = Array.isArray(inOff) ? 0 : inOff || 0;
      header.shm_out_offset = Array.isArray(outOff) ? 0 : outOff || 0;
      try {
        // Direct: the agent writes into this process's buffers, so wait for its answer
        // even when the job broke (it fails the collective within about a second); only
        // an agent that is gone cannot answer.
        got = await d.run(header, send && !seg ? send.bufs : [], direct ? () => this._gone()
          : () => this._broken(), direct, (send ? send.total : 0) + (recv ? recv.total : 0));
      } catch (e) {
        abandoned = true;
        throw e;
      } finally {
        header.shm_process = false;
        header.shm_in_blocks = [];
        header.shm_out_blocks = [];
        if (!got) {
          header.shm = header.shm_out = '';
          header.shm_in_offset = '0';
          header.shm_out_offset = '0';
        }
      }
      if (!got) return null;
      if (got.code) throw makeError(what, got.code, got.message);
      const want = recv ? recv.total : 0;
      if (want && seg) {
        seg.get(outOff, want, recv);
      } else if (want && !got.out) {
        throw new ParamsyncError(`${what}: the agent answered the doorbell without the ` +
          'output', grpc.status.INTERNAL);
      } else if (want) {
        recv.write(0, got.out.subarray(0, want));
      }
      return { source: got.source };
    } finally {
      if (seg && (got || abandoned)) seg.end(abandoned);
    }
  }

  /** Takes the World's payload segment, or a spare when it is busy, for one collective
   * (its input written in): [segment, output offset], or [null, null] (gRPC frames).
   * rung: a doorbell carries it, so any size goes. */
  async _claimSegment(inPlace, send, recv, rung) {
    const off = await this.shm.begin(inPlace, send, recv, rung);
    if (off !== null) return [this.shm, off];
    if (this.shm.inUse && !this.shm.disabled) { // busy: a spare
      const spare = await this.spares.begin(inPlace, send, recv, this.shm.slots, rung);
      if (spare) return [spare.seg, spare.off];
    }
    return [null, null];
  }

  /** A small collective of its own for a step of another call, with sequence number seq:
   * send and recv typed arrays (recv may be send). */
  _small(g, seq, kind, dtype, send, recv, name, op = 0, timeoutMs = 0) {
    const h = this._header(g, seq, { kind, op, dtype, count: send.length, timeoutMs });
    return this._run(g, h, new Segments([view(send, 'send')]),
      new Segments([view(recv, 'recv')]), name);
  }

  /** Barrier k (from 1) of g's barriers that may meet directly. Resolves to true when
   * done; false when it is to go through the agent as any barrier. */
  _barRun(g, header, k, name) {
    const b = g._bar;
    const seq = Number(header.seq);
    if (k <= 2) {
      // The setup calls keep the barrier's deadline (monitoredBarrier's own).
      const ms = Number(header.timeout_ms);
      const step = k === 1 ? this._barMap(g, b, seq, name, ms)
        : this._barAgree(g, b, seq, name, ms);
      b.steps[k - 1] = step.then(() => undefined, () => undefined);
      return step.then(() => true);
    }
    return b.steps[1].then(async () => {
      if (!b.ab) return false;
      const m = (seq + 1) >>> 0; // by sequence number, as the C client
      const timeoutMs = Number(header.timeout_ms); // the World's, as every call's header has
      // The only collective in flight in the process: it may wait on the loop's thread.
      const lone = doorbellWorlds <= 1 && this.doorbells.inFlight === 0 && this.barWaiting === 0;
      this.barWaiting++;
      let met;
      try {
        met = await b.meet(g.rank(), g.size(), m, Date.now() + timeoutMs,
          () => this._broken(), lone ? waitNowUs() : 0);
      } finally {
        this.barWaiting--;
      }
      if (met === MEET.MET) return true;
      // A rank called another collective under this number: through the agent, the hub
      // fails both sides at once.
      if (met === MEET.MISMATCH) return false;
      const missing = b.missing(g.ranks, m);
      throw makeError(`${name} (group ${g.id}, seq ${seq})`, grpc.status.DEADLINE_EXCEEDED,
        `rank${missing.length > 1 ? 's' : ''} ${missing.join(', ')} did not arrive within ` +
        `${timeoutMs} ms (met directly on this host)`);
    });
  }

  /** Direct barriers' setup step 1: rank 0 makes the page, its name goes round as the
   * barrier's call (an all_gather), the others map it. */
  async _barMap(g, b, seq, name, timeoutMs) {
    const mine = g.rank() === 0 ? b.make() : Buffer.alloc(BAR.NAME);
    const got = new Uint8Array(g.size() * BAR.NAME);
    await this._small(g, seq, KIND.ALL_GATHER, DTYPES.uint8, new Uint8Array(mine), got, name, 0,
      timeoutMs);
    if (g.rank() !== 0) b.open(Buffer.from(got.buffer, 0, BAR.NAME));
  }

  /** Step 2, once step 1 ended here: whether every rank mapped it, agreed (an all_reduce
   * MIN as the barrier's call); rank 0 unlinks the name either way. */
  async _barAgree(g, b, seq, name, timeoutMs) {
    await b.steps[0];
    const ok = new Int32Array([b.ab ? 1 : 0]);
    let agreed = false;
    try {
      await this._small(g, seq, KIND.ALL_REDUCE, DTYPES.int32, ok, ok, name, ReduceOp.MIN,
        timeoutMs);
      agreed = ok[0] === 1;
    } finally {
      b.unlink(); // every rank tried to open it before it came here
      if (!agreed) b.close(); // through the agent for good
    }
  }

  /** Runs header's all_to_all, all_gather, gather or scatter by peer copies. Resolves to
   * true when done; false when it is to go through the agent, with header.seq the number
   * it now goes under. uneven: an uneven allToAllSingle's blocks in the caller's arrays
   * (Uneven), read pair by pair instead of the padded send and recv. */
  async _peerRun(g, header, send, recv, name, uneven = null) {
    const n = g.size();
    const rank = g.rank();
    const seq = Number(header.seq);
    const kind = header.kind;
    const block = Number(header.count) * ELEMENT_BYTES[header.dtype];
    const nb = blocksPerRank(kind) ? n : 1;
    // Memory from empty() the agent copies in place, between its mappings (where one
    // allocation holds input and output): faster than reads that pin its shared pages one
    // by one (client/peer.c), unless the call is over its --shm-resident-bytes (it would
    // copy through the files). Asked of the buffers the agent would take: an uneven
    // all_to_all's are padded ones unless a side is the caller's own.
    const agentInPlace = this.mem.inPlace(send, recv, agentTouches(kind, n, block));
    let ins; let outs;
    if (uneven) {
      ({ send, recv, ins, outs } = uneven);
    } else {
      ins = send ? peerBlocks(send, nb, block) : [];
      outs = recv ? peerBlocks(recv, kind === KIND.SCATTER ? 1 : n, block) : [];
    }
    // PARAMSYNC_SHM=0 set since init: payloads over gRPC, as asked.
    const fits = ins !== null && outs !== null && shmEnabled() && !agentInPlace;
    // A rank with no input (a scatter's other ranks) describes nb blocks of 0, as every
    // rank's descriptor is one size.
    const addrs = fits && ins.length ? ins.map(([b, off]) => (b.length
      ? native.address(b.buffer) + b.byteOffset + off : 0)) : new Array(nb).fill(0);
    // Input in one empty() allocation whose file stays open: the others may map it.
    const mapped = peerMapWanted();
    const seg = fits && ins.length && mapped &&
      ins.every(([b]) => b.buffer === ins[0][0].buffer) ? this.mem.segmentOf(ins[0][0].buffer)
      : null;
    const desc = this.peerSelf.describe(addrs, fits, seg);
    const words = desc.length;
    const got = new BigUint64Array(n * words);
    await this._small(g, seq, KIND.ALL_GATHER, DTYPES.uint8,
      new Uint8Array(desc.buffer), new Uint8Array(got.buffer), `${name} (peer addresses)`);
    const d = peerAllFit(got, n, words);
    if (!d) {
      header.seq = seq + 1;
      return false;
    }
    for (const x of [send, recv]) for (const b of x ? x.bufs : []) collapse(b);
    const since = mapped ? native.peerMapClock() : 0;
    const ok = peerPull(kind, n, rank, header.root, d, words, uneven ? uneven.sizes : block,
      outs, ins, mapped);
    // Mappings this call did not use whose owner let the file go (freed, or left).
    if (mapped) native.peerMapSweep(since);
    const failed = new Int32Array([ok ? 0 : 1]);
    await this._small(g, seq + 1, KIND.ALL_REDUCE, DTYPES.int32, failed, failed,
      `${name} (peer copies done)`, ReduceOp.MAX);
    if (failed[0] === 0) {
      this.peerUsed++;
      return true;
    }
    header.seq = seq + 2;
    return false;
  }

  async _run(g, header, send, recv, name) {
    const chunk = chunkBytes();
    const what = `${name} (group ${g.id}, seq ${header.seq})`;
    header.chunk_bytes = chunk;
    this._check();
    // all_reduce and reduce: the agent writes the output over the input.
    const inPlace = header.kind === KIND.ALL_REDUCE || header.kind === KIND.REDUCE;
    // Input and output in memory from empty(): the agent uses them where they are.
    const mem = this.mem.begin(inPlace, send, recv);
    // A doorbell when one is free: the payload in it when small, else in memory from
    // empty(), this process's buffers or the segment (when the agent takes that);
    // otherwise a Collective call.
    const d = await this.doorbells.begin();
    const small = !mem && (send ? send.total : 0) <= DB.PAYLOAD &&
      (recv ? recv.total : 0) <= DB.PAYLOAD;
    let shm = null;
    let inOff = 0;
    let shmOff = null;
    try {
      if (d && small) {
        const got = await this._ring(d, header, send, recv, null, 0, DB.OUT, what);
        if (got) return got;
      }
      // The doorbell with another segment of the rank.
      let rung = !!(d && !small && d.segments);
      // Large buffers of this process: the agent reads and writes them where they are.
      const direct = rung && !mem ? await this.proc.begin(inPlace, send, recv) : null;
      if (direct) {
        const seg = { name: this.proc.name, direct: true, get() {}, end() {} };
        const got = await this._ring(d, header, send, recv, seg, direct.in, direct.out, what);
        if (got) return got;
        rung = false; // its header did not fit: a call
      }
      if (mem) ({ seg: shm, inOff, outOff: shmOff } = mem);
      else [shm, shmOff] = await this._claimSegment(inPlace, send, recv, rung);
      if (rung && shm) {
        const got = await this._ring(d, header, send, recv, shm, inOff, shmOff, what);
        if (got) return got;
      }
    } finally {
      if (d) d.end();
    }
    if (shm) {
      header.shm = shm.name;
      header.shm_out = shm.outName || '';
      header.shm_in_offset = inOff;
      header.shm_out_offset = shmOff;
    }
    try {
      this._check();
    } catch (e) {
      if (shm) shm.end();
      throw e;
    }
    const deadline = Date.now() + (header.timeout_ms || this.timeoutMs) + 30000;
    const call = this.client.Collective(this.md, { deadline });
    this.inflight.add(call);
    const want = recv ? recv.total : 0;
    return new Promise((resolveRun, rejectRun) => {
      let result = null;
      let got = 0;
      let failure = null;
      let finished = false;
      let inShm = false;
      const finish = new Promise((res) => call.on('status', res));
      call.on('data', (frame) => {
        if (failure) return;
        if (frame.result && !result) {
          result = frame.result;
          if (result.code) {
            failure = makeError(what, result.code, result.message);
            call.cancel();
            return;
          }
          if (result.shm) {
            if (!shm) {
              failure = new ParamsyncError(`${what}: the daemon answered in shared memory ` +
                'this call did not use', grpc.status.INTERNAL);
            } else if (Number(result.bytes) !== want) {
              failure = new ParamsyncError(`${what}: the daemon announced ${result.bytes} ` +
                `result bytes; this rank expects ${want}`, grpc.status.DATA_LOSS);
            }
            if (failure) {
              call.cancel();
              return;
            }
            inShm = true;
          }
        }
        if (frame.data && frame.data.length) {
          const off = Number(frame.offset);
          if (!recv || !recv.write(off, frame.data)) {
            failure = new ParamsyncError(`${what}: the daemon sent bytes ${off}..` +
              `${off + frame.data.length}, beyond the ${recv ? recv.total : 0} expected`,
            grpc.status.DATA_LOSS);
            call.cancel();
            return;
          }
          got += frame.data.length;
        }
      });
      call.on('error', (e) => {
        if (failure) return;
        if (this.failure && e.code === grpc.status.CANCELLED) {
          failure = new ParamsyncError(`${what}: ${this.failure.message}`, this.failure.code,
            this.failure.details);
        } else {
          failure = makeError(what, e.code, e.details || e.message);
        }
      });
      call.on('status', (st) => {
        finished = true;
        this.inflight.delete(call);
        if (shm) {
          // Only an OK status makes the output in the segment the answer. A call
          // cancelled here may still have the agent using the segment: a new one next.
          if (!failure && st.code === grpc.status.OK && inShm && want) {
            try {
              shm.get(shmOff, want, recv);
              got = want;
            } catch (e) {
              failure = new ParamsyncError(`${what}: reading the result from shared memory: ` +
                `${e.message}`, grpc.status.DATA_LOSS);
            }
          }
          shm.end(st.code === grpc.status.CANCELLED);
        }
        if (!failure && got !== want) {
          failure = new ParamsyncError(`${what}: received ${got} bytes, expected ${want}`,
            grpc.status.DATA_LOSS);
        }
        if (failure) rejectRun(failure); else resolveRun(result);
      });
      // Send concurrently with receiving, respecting flow control.
      (async () => {
        // With shared memory the header travels alone.
        const it = send && !shm ? send.chunks(chunk) : [][Symbol.iterator]();
        let n = it.next();
        let off = 0;
        let frame = { header, data: n.done ? Buffer.alloc(0) : n.value };
        for (;;) {
          if (finished) return;
          const len = frame.data.length;
          const ok = call.write(frame);
          off += len;
          n = it.next();
          if (n.done) break;
          frame = { offset: off, data: n.value };
          if (!ok) await Promise.race([new Promise((res) => call.once('drain', res)), finish]);
        }
        if (!finished) call.end();
      })().catch((e) => {
        if (!failure) failure = e;
        call.cancel();
      });
    });
  }

  /** A CollectiveHeader for this rank of group g with sequence number seq. */
  _header(g, seq, { kind, op = 0, dtype = 0, count = 0, root = 0, peer = 0, tag = 0,
    timeoutMs = 0 }) {
    // 64-bit fields as numbers (below 2^53) or a Long made once: protobufjs parses
    // strings digit by digit into a Long on every encode, a few percent of a small call.
    return { job: this.job, group: g.id, seq, kind, op, dtype,
      count, root, peer, rank: g.rank(), tag, timeout_ms: timeoutMs || this.timeoutMs,
      incarnation: this.incarnation };
  }

  _start(g, name, kind, { send = [], recv = [], op = 0, dtype = 0, count = 0, root = 0,
    peer = 0, tag = 0, source = false, outputs, timeoutMs = 0, uneven = null } = {}) {
    this._check();
    if (g._stepsBusy && !g._inStep) throw stepsBusy(name, g._stepsBusy);
    // Peer copies hold three sequence numbers. Decided from what every rank of the group
    // has alike: the kind, the block's bytes, the coordinator's sets.
    const peerCopies = peerTakes(kind, count * ELEMENT_BYTES[dtype], this.peerSets, g.ranks,
      this.rank);
    let seq;
    if (kind === KIND.SEND) {
      seq = g._sendSeq.get(peer) || 0;
      g._sendSeq.set(peer, seq + 1);
    } else if (kind === KIND.RECV) {
      seq = g._recvSeq++;
    } else {
      seq = g._seq;
      g._seq += peerCopies ? PEER.SEQS : 1;
    }
    const header = this._header(g, seq, { kind, op, dtype, count, root, peer, tag, timeoutMs });
    if (uneven) { // the agents need not move the padding, nor count it
      header.block_used = uneven.blockUsed();
      header.block_out_used = uneven.blockOutUsed();
    }
    const sendSegs = send.length ? new Segments(send) : null;
    const recvSegs = recv.length ? new Segments(recv) : null;
    // Direct barriers, counted per group, alike on every rank.
    const barK = kind === KIND.BARRIER && barrierTakes(this.barrierSets, g.ranks, this.rank)
      ? ++g._bar.calls : 0;
    if (!barK && kind !== KIND.SEND && kind !== KIND.RECV) {
      g._bar.started(g.rank(), seq);
    }
    // Through the agent: an uneven allToAllSingle's padded input filled now.
    const run = () => {
      if (uneven) uneven.pack();
      return this._run(g, header, sendSegs, recvSegs, name);
    };
    const p = peerCopies || barK
      ? (peerCopies ? this._peerRun(g, header, sendSegs, recvSegs, name, uneven)
        : this._barRun(g, header, barK, name)).then((done) => (done ? null : run()))
      : run();
    return p.then((result) => {
      if (source) {
        const s = result ? result.source : -1;
        return s >= 0 && s < g.size() ? g.ranks[s] : s;
      }
      return outputs;
    });
  }

  // -------------------------------------------------------------- groups

  _group(group, name) {
    if (group === undefined || group === null || group === WORLD) return this.worldGroup;
    if (group === NON_GROUP_MEMBER) {
      if (name) {
        process.emitWarning(`Running ${name} on global rank ${this.rank} which does not ` +
          'belong to the given group.');
      }
      return null;
    }
    if (!(group instanceof ProcessGroup) || group.world !== this) {
      throw new RangeError(`${String(group)} is not a group of this process group`);
    }
    return group;
  }

  /** torch's new_group: every rank calls it in the same order; resolves to the group, or
   * GroupMember.NON_GROUP_MEMBER on a rank that is not in `ranks` (job ranks). */
  async newGroup(ranks) {
    this._check();
    const list = ranks === undefined || ranks === null ? [...Array(this.size).keys()]
      : Array.from(ranks, Number);
    if (new Set(list).size !== list.length) {
      throw new RangeError(`newGroup: ranks ${list} list a rank twice`);
    }
    for (const r of list) {
      if (!Number.isInteger(r) || r < 0 || r >= this.size) {
        throw new RangeError(`newGroup: rank ${r} is outside the world of ${this.size}`);
      }
    }
    const gid = ++this.nNewGroups;
    const resp = await new Promise((res, rej) => {
      this.client.NewGroup({ job: this.job, group: gid, ranks: list, rank: this.rank }, this.md,
        { deadline: Date.now() + this.timeoutMs + 30000 }, (err, r) => {
          if (err) rej(makeError(`newGroup (group ${gid}, ranks ${list})`, err.code,
            err.details || err.message));
          else res(r);
        });
    });
    if (resp.group_rank < 0) return NON_GROUP_MEMBER;
    return new ProcessGroup(this, resp.group || gid, list, resp.group_rank);
  }

  /** torch's new_subgroups: the world cut into groups of groupSize consecutive ranks,
   * every rank calling it; resolves to [this rank's group, all of them]. */
  async newSubgroups(groupSize) {
    if (!Number.isInteger(groupSize) || groupSize <= 0) {
      throw new RangeError(`newSubgroups: groupSize must be a positive integer, not ${groupSize}`);
    }
    if (groupSize > this.size || this.size % groupSize) {
      throw new RangeError(`newSubgroups: the world size ${this.size} must be a multiple of ` +
        `groupSize ${groupSize}`);
    }
    const lists = [];
    for (let k = 0; k < this.size; k += groupSize) {
      lists.push(Array.from({ length: groupSize }, (_, i) => k + i));
    }
    return this.newSubgroupsByEnumeration(lists);
  }

  /** torch's new_subgroups_by_enumeration: a group for each array of ranks (a rank in one
   * at most, checked before any group is made); resolves to [this rank's group or null,
   * all of them]. */
  async newSubgroupsByEnumeration(rankLists) {
    if (!Array.isArray(rankLists) || rankLists.length === 0) {
      throw new RangeError('newSubgroupsByEnumeration: rankLists cannot be empty');
    }
    const first = new Map();
    for (const ranks of rankLists) {
      for (const r of ranks) {
        if (first.has(r)) {
          throw new RangeError(`newSubgroupsByEnumeration: rank ${r} has appeared in both ` +
            `subgroup ${first.get(r)} and ${ranks}`);
        }
        first.set(r, ranks);
      }
    }
    const groups = [];
    let mine = null;
    for (const ranks of rankLists) {
      const g = await this.newGroup(ranks);
      groups.push(g);
      if (Array.from(ranks, Number).includes(this.rank)) mine = g;
    }
    return [mine, groups];
  }

  getRank(group) { const g = this._group(group); return g ? g.rank() : -1; }

  getWorldSize(group) { const g = this._group(group); return g ? g.size() : -1; }

  // -------------------------------------------------------------- collectives

  barrier(opts = {}) {
    const g = this._group(opts.group, 'barrier');
    if (!g) return Promise.resolve(undefined);
    return this._start(g, 'barrier', KIND.BARRIER, { outputs: [] });
  }

  /** torch's monitored_barrier: a barrier with a deadline of its own (opts.timeout, ms;
   * default the World's); a rank missing by then fails it on every rank that came, with
   * DEADLINE_EXCEEDED naming every missing rank. */
  monitoredBarrier(opts = {}) {
    const g = this._group(opts.group, 'monitoredBarrier');
    if (!g) return Promise.resolve(undefined);
    const t = opts.timeout === undefined ? 0 : Number(opts.timeout);
    if (opts.timeout !== undefined && !(t > 0 && t <= 0xFFFFFFFF)) {
      throw new RangeError(`monitoredBarrier: timeout must be positive milliseconds, not ${opts.timeout}`);
    }
    return this._start(g, 'monitored_barrier', KIND.BARRIER, { outputs: [],
      timeoutMs: Math.ceil(t) });
  }

  broadcast(tensor, src, opts = {}) {
    const g = this._group(opts.group, 'broadcast');
    if (!g) return Promise.resolve(undefined);
    const v = view(tensor, 'tensor', opts.dtype);
    const root = groupRank(g, src, 'broadcast: src');
    const me = g.rank();
    return this._start(g, 'broadcast', KIND.BROADCAST, { send: me === root ? [v] : [],
      recv: me !== root ? [v] : [], dtype: v.dtype, count: v.numel, root, outputs: tensor });
  }

  allReduce(tensor, opts = {}) {
    const g = this._group(opts.group, 'allReduce');
    if (!g) return Promise.resolve(undefined);
    const v = view(tensor, 'tensor', opts.dtype);
    const op = checkOp(opts.op, v.dtype, 'allReduce');
    return this._start(g, 'all_reduce', KIND.ALL_REDUCE, { send: [v], recv: [v], op,
      dtype: v.dtype, count: v.numel, outputs: tensor });
  }

  reduce(tensor, dst, opts = {}) {
    const g = this._group(opts.group, 'reduce');
    if (!g) return Promise.resolve(undefined);
    const v = view(tensor, 'tensor', opts.dtype);
    const op = checkOp(opts.op, v.dtype, 'reduce');
    const root = groupRank(g, dst, 'reduce: dst');
    return this._start(g, 'reduce', KIND.REDUCE, { send: [v], recv: g.rank() === root ? [v] : [],
      op, dtype: v.dtype, count: v.numel, root, outputs: tensor });
  }

  allGather(tensorList, tensor, opts = {}) {
    const g = this._group(opts.group, 'allGather');
    if (!g) return Promise.resolve(undefined);
    const v = view(tensor, 'tensor', opts.dtype);
    const outs = listOf(tensorList, 'allGather', 'tensorList', g.size(), opts.dtype);
    same(outs, v, 'allGather', 'tensorList');
    return this._start(g, 'all_gather', KIND.ALL_GATHER, { send: snapshot([v], outs),
      recv: outs, dtype: v.dtype, count: v.numel, outputs: tensorList });
  }

  allGatherIntoTensor(output, input, opts = {}) {
    const g = this._group(opts.group, 'allGatherIntoTensor');
    if (!g) return Promise.resolve(undefined);
    const i = view(input, 'input', opts.dtype);
    const o = view(output, 'output', opts.dtype);
    if (o.dtype !== i.dtype) throw new TypeError('allGatherIntoTensor: output and input dtypes differ');
    if (o.numel !== i.numel * g.size()) {
      throw new RangeError(`allGatherIntoTensor: output has ${o.numel} elements, need ` +
        `${g.size()} x ${i.numel}`);
    }
    return this._start(g, 'all_gather_into_tensor', KIND.ALL_GATHER, {
      send: snapshot([i], [o]), recv: [o], dtype: i.dtype, count: i.numel, outputs: output });
  }

  gather(tensor, gatherList = null, dst = 0, opts = {}) {
    const g = this._group(opts.group, 'gather');
    if (!g) return Promise.resolve(undefined);
    const v = view(tensor, 'tensor', opts.dtype);
    const root = groupRank(g, dst, 'gather: dst');
    let outs = [];
    if (g.rank() === root) {
      if (!gatherList) throw new RangeError('gather: gatherList must be given on the destination rank');
      outs = listOf(gatherList, 'gather', 'gatherList', g.size(), opts.dtype);
      same(outs, v, 'gather', 'gatherList');
    } else if (gatherList && gatherList.length) {
      throw new RangeError('gather: gatherList must NOT be given on non-destination ranks');
    }
    return this._start(g, 'gather', KIND.GATHER, { send: snapshot([v], outs), recv: outs,
      dtype: v.dtype, count: v.numel, root, outputs: gatherList });
  }

  scatter(tensor, scatterList = null, src = 0, opts = {}) {
    const g = this._group(opts.group, 'scatter');
    if (!g) return Promise.resolve(undefined);
    const v = view(tensor, 'tensor', opts.dtype);
    const root = groupRank(g, src, 'scatter: src');
    let ins = [];
    if (g.rank() === root) {
      if (!scatterList) throw new RangeError('scatter: scatterList must be given on the source rank');
      ins = listOf(scatterList, 'scatter', 'scatterList', g.size(), opts.dtype);
      same(ins, v, 'scatter', 'scatterList');
      ins = snapshot(ins, [v]);
    } else if (scatterList && scatterList.length) {
      throw new RangeError('scatter: scatterList must NOT be given on non-source ranks');
    }
    return this._start(g, 'scatter', KIND.SCATTER, { send: ins, recv: [v], dtype: v.dtype,
      count: v.numel, root, outputs: tensor });
  }

  reduceScatter(output, inputList, opts = {}) {
    const g = this._group(opts.group, 'reduceScatter');
    if (!g) return Promise.resolve(undefined);
    const o = view(output, 'output', opts.dtype);
    const ins = listOf(inputList, 'reduceScatter', 'inputList', g.size(), opts.dtype);
    same(ins, o, 'reduceScatter', 'inputList');
    const op = checkOp(opts.op, o.dtype, 'reduceScatter');
    return this._start(g, 'reduce_scatter', KIND.REDUCE_SCATTER, { send: snapshot(ins, [o]),
      recv: [o], op, dtype: o.dtype, count: o.numel, outputs: output });
  }

  reduceScatterTensor(output, input, opts = {}) {
    const g = this._group(opts.group, 'reduceScatterTensor');
    if (!g) return Promise.resolve(undefined);
    const o = view(output, 'output', opts.dtype);
    const i = view(input, 'input', opts.dtype);
    if (o.dtype !== i.dtype) throw new TypeError('reduceScatterTensor: output and input dtypes differ');
    if (i.numel !== o.numel * g.size()) {
      throw new RangeError(`reduceScatterTensor: input has ${i.numel} elements, need ` +
        `${g.size()} x ${o.numel}`);
    }
    const op = checkOp(opts.op, o.dtype, 'reduceScatterTensor');
    return this._start(g, 'reduce_scatter_tensor', KIND.REDUCE_SCATTER, {
      send: snapshot([i], [o]), recv: [o], op, dtype: o.dtype, count: o.numel, outputs: output });
  }

  allToAll(outputList, inputList, opts = {}) {
    const g = this._group(opts.group, 'allToAll');
    if (!g) return Promise.resolve(undefined);
    if (isTensor(outputList) || isTensor(inputList)) {
      throw new TypeError('allToAll takes arrays of tensors (use allToAllSingle for tensors)');
    }
    const outs = listOf(outputList, 'allToAll', 'outputList', g.size(), opts.dtype);
    const ins = listOf(inputList, 'allToAll', 'inputList', g.size(), opts.dtype);
    same(outs, ins[0], 'allToAll', 'outputList');
    same(ins, ins[0], 'allToAll', 'inputList');
    return this._start(g, 'all_to_all', KIND.ALL_TO_ALL, { send: snapshot(ins, outs),
      recv: outs, dtype: ins[0].dtype, count: ins[0].numel, outputs: outputList });
  }

  allToAllSingle(output, input, opts = {}) {
    const g = this._group(opts.group, 'allToAllSingle');
    if (!g) return Promise.resolve(undefined);
    const o = view(output, 'output', opts.dtype);
    const i = view(input, 'input', opts.dtype);
    const n = g.size();
    if (o.dtype !== i.dtype) throw new TypeError('allToAllSingle: output and input dtypes differ');
    // Split sizes take two steps; decided by whether they are given, never by their
    // values (splits that look even on one rank can be uneven on another).
    const given = (x) => x !== undefined && x !== null && x.length > 0;
    if (given(opts.outputSplitSizes) || given(opts.inputSplitSizes)) {
      return this._allToAllUneven(g, o, i, output, opts);
    }
    if (i.numel !== o.numel || i.numel % n) {
      throw new RangeError(`allToAllSingle: input (${i.numel}) and output (${o.numel}) must ` +
        `be the same size, a multiple of the group size ${n} (or give split sizes)`);
    }
    return this._start(g, 'all_to_all_single', KIND.ALL_TO_ALL, { send: snapshot([i], [o]),
      recv: [o], dtype: i.dtype, count: i.numel / n, outputs: output });
  }

  /** Resolves when the daemon has taken the tensor (torch's send; isend is the same). */
  send(tensor, dst, opts = {}) {
    const g = this._group(opts.group, 'send');
    if (!g) return Promise.resolve(undefined);
    const v = view(tensor, 'tensor', opts.dtype);
    const peer = p2pPeer(g, dst, 'send: dst');
    return this._start(g, 'send', KIND.SEND, { send: [v], dtype: v.dtype, count: v.numel, peer,
      tag: checkTag(opts.tag) });
  }

  /** Resolves to the sender's global rank; src null/undefined: any source. */
  recv(tensor, src = null, opts = {}) {
    const g = this._group(opts.group, 'recv');
    if (!g) return Promise.resolve(-1);
    const v = view(tensor, 'tensor', opts.dtype);
    const peer = src === null || src === undefined ? -1 : p2pPeer(g, src, 'recv: src');
    return this._start(g, 'recv', KIND.RECV, { recv: [v], dtype: v.dtype, count: v.numel, peer,
      tag: checkTag(opts.tag), source: true });
  }

  isend(tensor, dst, opts) { return this.send(tensor, dst, opts); }

  irecv(tensor, src, opts) { return this.recv(tensor, src, opts); }

  // -------------------------------------------------------------- in steps

  // The object collectives and an uneven allToAllSingle take two collectives, the second
  // numbered when the first ends, so another collective on the same group may not start
  // in between (starting one is an error, before anything is sent). body(step) runs them:
  // step(start, last) starts one, last when no other follows.
  async _steps(g, name, body) {
    if (g._stepsBusy) throw stepsBusy(name, g._stepsBusy);
    g._stepsBusy = name;
    let open = true;
    const step = (start, last = false) => {
      g._inStep = true;
      try {
        return start();
      } finally {
        g._inStep = false;
        if (last) {
          g._stepsBusy = null;
          open = false;
        }
      }
    };
    try {
      return await body(step);
    } finally {
      if (open) g._stepsBusy = null;
    }
  }

  /** One collective of arrays made here, named in errors by the call it serves. */
  _inner(g, name, kind, { send = [], recv = [], count, root = 0, uneven = null }) {
    const s = send.map((a) => view(a, name));
    const r = recv.map((a) => view(a, name));
    return this._start(g, name, kind, { send: s, recv: r, dtype: (s[0] || r[0]).dtype, count,
      root, outputs: null, uneven });
  }

  // -------------------------------------------------------------- objects

  // torch's object collectives: each object is serialized (v8.serialize, Node's structured
  // clone: what Python pickles there) into a Uint8Array and moved by collectives of its
  // own, its size first.

  /** Every rank's serialized size, in group rank order (one all_gather of int64s). */
  _objectSizes(g, name, data) {
    const sizes = new BigInt64Array(g.size());
    return this._inner(g, name, KIND.ALL_GATHER, {
      send: [BigInt64Array.of(BigInt(data.length))], recv: [sizes], count: 1 })
      .then(() => sizes);
  }

  async allGatherObject(objectList, obj, opts = {}) {
    const name = 'allGatherObject';
    const g = this._group(opts.group, name);
    if (!g) return undefined;
    const n = g.size();
    objectArray(objectList, name, 'objectList', n);
    const data = v8.serialize(obj);
    return this._steps(g, name, async (step) => {
      const sizes = await step(() => this._objectSizes(g, name, data));
      const m = largest(sizes);
      const out = new Uint8Array(n * m);
      await step(() => this._inner(g, name, KIND.ALL_GATHER, { send: [padded(data, m)],
        recv: [out], count: m }), true);
      for (let i = 0; i < n; i++) {
        objectList[i] = deserialized(out.subarray(i * m), sizes[i], name, g.ranks[i]);
      }
      return objectList;
    });
  }

  async gatherObject(obj, objectGatherList = null, dst = 0, opts = {}) {
    const name = 'gatherObject';
    const g = this._group(opts.group, name);
    if (!g) return undefined;
    const n = g.size();
    const root = groupRank(g, dst, 'gatherObject: dst');
    const mine = g.rank() === root;
    if (mine) {
      if (!objectGatherList) {
        throw new RangeError('gatherObject: objectGatherList must be given on the destination rank');
      }
      objectArray(objectGatherList, name, 'objectGatherList', n);
    } else if (objectGatherList && objectGatherList.length) {
      throw new RangeError('gatherObject: objectGatherList must NOT be given on non-destination ranks');
    }
    const data = v8.serialize(obj);
    return this._steps(g, name, async (step) => {
      const sizes = await step(() => this._objectSizes(g, name, data));
      const m = largest(sizes);
      const outs = mine ? Array.from({ length: n }, () => new Uint8Array(m)) : [];
      await step(() => this._inner(g, name, KIND.GATHER, { send: [padded(data, m)],
        recv: outs, count: m, root }), true);
      if (!mine) return null;
      for (let i = 0; i < n; i++) {
        objectGatherList[i] = deserialized(outs[i], sizes[i], name, g.ranks[i]);
      }
      return objectGatherList;
    });
  }

  async broadcastObjectList(objectList, src = 0, opts = {}) {
    const name = 'broadcastObjectList';
    const g = this._group(opts.group, name);
    if (!g) return undefined;
    const root = groupRank(g, src, 'broadcastObjectList: src');
    objectArray(objectList, name, 'objectList', null);
    const mine = g.rank() === root;
    const datas = mine ? objectList.map((o) => v8.serialize(o)) : [];
    const sizes = BigInt64Array.from(mine ? datas.map((d) => BigInt(d.length))
      : objectList.map(() => 0n));
    const one = (a) => (mine ? { send: [a] } : { recv: [a] });
    return this._steps(g, name, async (step) => {
      // The sizes go even for an empty list: the daemon compares the ranks' lengths.
      await step(() => this._inner(g, name, KIND.BROADCAST, { ...one(sizes),
        count: sizes.length, root }), sizes.length === 0);
      if (!sizes.length) return objectList;
      const buf = mine ? Buffer.concat(datas)
        : new Uint8Array(Number(sizes.reduce((a, b) => a + b, 0n)));
      await step(() => this._inner(g, name, KIND.BROADCAST, { ...one(buf), count: buf.length,
        root }), true);
      if (!mine) {
        let at = 0;
        for (let i = 0; i < sizes.length; i++) {
          objectList[i] = deserialized(buf.subarray(at), sizes[i], name, src);
          at += Number(sizes[i]);
        }
      }
      return objectList;
    });
  }

  async scatterObjectList(outputList, inputList = null, src = 0, opts = {}) {
    const name = 'scatterObjectList';
    const g = this._group(opts.group, name);
    if (!g) return undefined;
    const n = g.size();
    if (!Array.isArray(outputList) || outputList.length < 1) {
      throw new RangeError('scatterObjectList: outputList must be an array of at least one element');
    }
    const root = groupRank(g, src, 'scatterObjectList: src');
    const mine = g.rank() === root;
    let datas = [];
    let heads = [];
    if (mine) {
      if (!inputList) {
        throw new RangeError('scatterObjectList: inputList must be given on the source rank');
      }
      objectArray(inputList, name, 'inputList', n);
      datas = inputList.map((o) => v8.serialize(o));
      const m = datas.reduce((a, d) => Math.max(a, d.length), 0);
      // Each rank gets its size and the largest: one scatter of int64 pairs.
      heads = datas.map((d) => BigInt64Array.of(BigInt(d.length), BigInt(m)));
    }
    return this._steps(g, name, async (step) => {
      const head = new BigInt64Array(2);
      await step(() => this._inner(g, name, KIND.SCATTER, { send: heads, recv: [head],
        count: 2, root }));
      const m = Number(head[1]);
      const out = new Uint8Array(m);
      await step(() => this._inner(g, name, KIND.SCATTER, {
        send: datas.map((d) => padded(d, m)), recv: [out], count: m, root }), true);
      outputList[0] = deserialized(out, head[0], name, src);
      return outputList;
    });
  }

  // -------------------------------------------------------------- uneven all_to_all

  /** A Uint8Array of at least n bytes for padded blocks; give it back with _scratchGive.
   * The largest SCRATCH.KEEP of at most scratchMax bytes of each kind are kept for the
   * next call, whose pages are then mapped already (as Python's World.scratch). With
   * registered, memory of empty(), which the agent takes in place beside the call's other
   * buffer (header.shm_out): for calls through the agent. */
  async _scratch(n, registered = false) {
    const pool = registered ? this.scratchMem : this.scratchFree;
    const k = pool.findIndex((b) => b.length >= n);
    if (k >= 0) return pool.splice(k, 1)[0];
    const size = Math.max(n, 1);
    return registered ? new Uint8Array((await this.mem.alloc(size)).ab) : new Uint8Array(size);
  }

  /** keep false (the call failed, and may have been given up on while an agent still
   * wrote into them): not for the next call. */
  _scratchGive(bufs, registered = false, keepThem = true) {
    const pool = registered ? this.scratchMem : this.scratchFree;
    if (keepThem) pool.push(...bufs.filter(Boolean));
    pool.sort((a, b) => b.length - a.length);
    const keep = pool.filter((b) => b.length <= this.scratchMax).slice(0, SCRATCH.KEEP);
    const drop = pool.filter((b) => !keep.includes(b));
    if (!keepThem) drop.push(...bufs.filter(Boolean));
    pool.splice(0, pool.length, ...keep);
    // Best effort: the agent drops a rank's segments when it leaves anyway.
    if (registered) drop.forEach((b) => { this.mem.free(b.buffer).catch(() => {}); });
  }

  /** torch's all_to_all_single with split sizes (elements here: typed arrays have one
   * dimension), on the daemon's equal blocks: every rank's sizes gathered first, so that
   * every rank checks every pair alike and all fail together, then blocks padded to the
   * largest. */
  async _allToAllUneven(g, o, i, output, opts) {
    const name = 'allToAllSingle';
    const n = g.size();
    const ins = splitSizes(opts.inputSplitSizes, i.numel, n, 'input');
    const outs = splitSizes(opts.outputSplitSizes, o.numel, n, 'output');
    const esize = ELEMENT_BYTES[i.dtype];
    return this._steps(g, name, async (step) => {
      const table = new BigInt64Array(2 * n * n);
      await step(() => this._inner(g, name, KIND.ALL_GATHER, {
        send: [BigInt64Array.from([...ins, ...outs], BigInt)], recv: [table], count: 2 * n }));
      let m = 0;
      for (let a = 0; a < n; a++) {
        for (let b = 0; b < n; b++) {
          const sent = Number(table[a * 2 * n + b]);
          const expected = Number(table[b * 2 * n + n + a]);
          if (sent !== expected) {
            // Before the data step, which is then never numbered: the gate opens below.
            throw new RangeError(`${name}: group rank ${a} sends ${sent} elements to group ` +
              `rank ${b}, whose outputSplitSizes expect ${expected}`);
          }
          m = Math.max(m, sent);
        }
      }
      const mb = m * esize;
      // A side whose blocks are all of the largest size is read or written in place
      // (not both in one buffer: a call's input and output may not overlap).
      const ownIn = ins.every((k) => k === m);
      const apart = !overlaps([i], [o]);
      const ownOut = outs.every((k) => k === m) && (!ownIn || apart);
      // Where the ranks read each other (peer copies) the padded buffers are never
      // written: the input is padded only on the way to the agent (Uneven.pack), and
      // they are plain memory. Elsewhere the call goes through the agents, which take
      // padded blocks on empty() memory in place (as the C client's ps__scratch_take).
      const reg = !oneSet(this.peerSets, g.ranks, this.rank);
      const kept = [ownIn ? null : await this._scratch(n * mb, reg),
        ownOut ? null : await this._scratch(n * mb, reg)];
      const src = ownIn ? i.buf : kept[0].subarray(0, n * mb);
      const dst = ownOut ? o.buf : kept[1].subarray(0, n * mb);
      const u = new Uneven(i, o, ins, outs, esize, mb, ownIn ? null : src, ownOut ? null : dst,
        apart);
      let ok = false;
      try {
        await step(() => this._inner(g, name, KIND.ALL_TO_ALL, { send: [src], recv: [dst],
          count: mb, uneven: u }), true);
        u.unpack();
        ok = true;
      } finally {
        this._scratchGive(kept, reg, ok);
      }
      return output;
    });
  }

  getProcessGroupRanks(group) {
    const g = this._group(group);
    if (!g) throw new RangeError('not a member of the group');
    return g.ranks.slice();
  }
}

// Padded blocks kept for the next uneven allToAllSingle (World._scratch), as Python keeps
// them: the largest KEEP, each of at most World.scratchMax bytes ($PARAMSYNC_SCRATCH_BYTES,
// default BYTES, as the C and Python clients'); one not kept is made anew, its pages
// faulted in again, every call.
const SCRATCH = Object.freeze({ KEEP: 2, BYTES: 2 ** 30 });

/** An uneven allToAllSingle's blocks where they lie in the caller's arrays (views i and
 * o; ins and outs the elements of each rank's block, esize bytes each), which peer copies
 * read and write pair by pair (World._peerRun: sizes, the bytes this rank takes from
 * each rank; ins and outs null unless input and output are apart), and, when the call goes
 * through the agent instead, the padded blocks of mb bytes it moves (padIn, padOut; null
 * for a side sent or received as the array itself): pack() fills padIn and marks
 * viaAgent, unpack() then takes the output out of padOut. */
class Uneven {
  constructor(i, o, ins, outs, esize, mb, padIn, padOut, apart) {
    this.send = new Segments([i]);
    this.recv = new Segments([o]);
    const at = (buf, counts) => {
      let off = 0;
      return counts.map((k) => { const b = [buf, off]; off += k * esize; return b; });
    };
    this.ins = apart ? at(i.buf, ins) : null;
    this.outs = apart ? at(o.buf, outs) : null;
    this.sizes = outs.map((k) => k * esize);
    this.viaAgent = false;
    /** The blocks of flat (counts per rank) into pad's blocks of mb bytes, or back. */
    this._copy = (pad, flat, counts, toPad) => {
      let off = 0;
      counts.forEach((k, j) => {
        const b = k * esize;
        if (toPad) pad.set(flat.subarray(off, off + b), j * mb);
        else flat.set(pad.subarray(j * mb, j * mb + b), off);
        off += b;
      });
    };
    this._in = [padIn, i.buf, ins];
    this._out = [padOut, o.buf, outs];
    this._used = padIn ? ins.map((k) => k * esize) : [];
    this._outUsed = padOut ? outs.map((k) => k * esize) : [];
  }

  /** The bytes of each padded input block that are data (CollectiveHeader.block_used);
   * none where the input goes as it is. */
  blockUsed() {
    return this._used;
  }

  /** The same of each padded output block (CollectiveHeader.block_out_used). */
  blockOutUsed() {
    return this._outUsed;
  }

  pack() {
    this.viaAgent = true;
    if (this._in[0]) this._copy(...this._in, true);
  }

  unpack() {
    if (this.viaAgent && this._out[0]) this._copy(...this._out, false);
  }
}

// Every collective returns a promise, also for argument errors (a rejected one); the
// sequence number is still taken synchronously, when the method is called.
const COLLECTIVES = ['barrier', 'monitoredBarrier', 'broadcast', 'allReduce', 'reduce',
  'allGather',
  'allGatherIntoTensor', 'gather', 'scatter', 'reduceScatter', 'reduceScatterTensor',
  'allToAll', 'allToAllSingle', 'send', 'recv'];
// async methods: their argument errors reject too.
const OBJECT_COLLECTIVES = ['allGatherObject', 'gatherObject', 'broadcastObjectList',
  'scatterObjectList'];
for (const m of COLLECTIVES) {
  const impl = World.prototype[m];
  World.prototype[m] = function collective(...args) {
    try {
      return Promise.resolve(impl.apply(this, args));
    } catch (e) {
      return Promise.reject(e);
    }
  };
}

function stepsBusy(name, busy) {
  return new Error(`${name}: ${busy} on this group has not resolved yet; await it before ` +
    'starting another collective on the group (its second step is numbered when its first ' +
    'ends)');
}

function splitSizes(sizes, numel, n, what) {
  if (sizes === undefined || sizes === null || sizes.length === 0) {
    if (numel % n) {
      throw new RangeError(`allToAllSingle: ${what} has ${numel} elements, not a multiple of ` +
        `the group size ${n} (give ${what}SplitSizes)`);
    }
    return new Array(n).fill(numel / n);
  }
  const out = Array.from(sizes, Number);
  if (out.length !== n) {
    throw new RangeError(`allToAllSingle: ${what}SplitSizes has ${out.length} sizes; the ` +
      `group has ${n} ranks`);
  }
  if (out.some((k) => !Number.isInteger(k) || k < 0) || out.reduce((a, b) => a + b, 0) !== numel) {
    throw new RangeError(`allToAllSingle: ${what}SplitSizes ${out} must be counts >= 0 ` +
      `adding up to the ${what}'s ${numel} elements`);
  }
  return out;
}

function objectArray(list, name, what, n) {
  if (!Array.isArray(list)) throw new TypeError(`${name}: ${what} must be an array`);
  if (n !== null && list.length !== n) {
    throw new RangeError(`${name}: ${what} has ${list.length} elements; the group has ${n} ranks`);
  }
}

function largest(sizes) { return Number(sizes.reduce((a, b) => (b > a ? b : a), 0n)); }

function padded(data, m) {
  const buf = new Uint8Array(m);
  buf.set(data);
  return buf;
}

function deserialized(bytes, size, name, rank) {
  try {
    return v8.deserialize(bytes.subarray(0, Number(size)));
  } catch (e) {
    throw new TypeError(`${name}: the object from rank ${rank} could not be deserialized ` +
      `(${e.message}); every rank must pass objects serialized by Node.js`);
  }
}

function groupRank(g, globalRank, what) {
  const i = g.ranks.indexOf(Number(globalRank));
  if (!Number.isInteger(Number(globalRank)) || i < 0) {
    throw new RangeError(`${what}: the global rank ${globalRank} is not part of the group ` +
      `(ranks ${g.ranks})`);
  }
  return i;
}

function p2pPeer(g, rank, what) {
  const peer = groupRank(g, rank, what);
  if (peer === g.rank()) throw new RangeError(`${what}: a rank cannot send to or receive from itself`);
  return peer;
}

function checkTag(tag) {
  const t = tag === undefined ? 0 : tag;
  if (!Number.isInteger(t) || t < 0 || t > 0xFFFFFFFF) {
    throw new RangeError(`tag must be a non-negative 32-bit integer, got ${tag}`);
  }
  return t;
}

function checkOp(op, dtype, name) {
  const o = op === undefined ? ReduceOp.SUM : op;
  if (!Number.isInteger(o) || o < 0 || o >= OP_NAMES.length) {
    throw new RangeError(`${name}: op must be a ReduceOp, not ${op}`);
  }
  if (BITWISE.has(o) && FLOATING.has(dtype)) {
    throw new TypeError(`${name}: ReduceOp.${OP_NAMES[o]} is not defined on ` +
      `${DTYPE_NAMES[dtype]} tensors`);
  }
  return o;
}

function listOf(list, name, what, n, dtype) {
  if (!Array.isArray(list)) {
    throw new TypeError(`${name}: ${what} must be an array of tensors`);
  }
  if (list.length !== n) {
    throw new RangeError(`${name}: ${what} has ${list.length} tensors; the group has ${n} ranks`);
  }
  return list.map((t, i) => view(t, `${what}[${i}]`, dtype));
}

function same(views, ref, name, what) {
  views.forEach((v, i) => {
    if (v.dtype !== ref.dtype) {
      throw new TypeError(`${name}: ${what}[${i}] is ${DTYPE_NAMES[v.dtype]} but the tensor is ` +
        `${DTYPE_NAMES[ref.dtype]} (one dtype per collective)`);
    }
    if (v.numel !== ref.numel) {
      throw new RangeError(`${name}: ${what}[${i}] has ${v.numel} elements but the tensor has ` +
        `${ref.numel}`);
    }
  });
}

// ------------------------------------------------------------------ the default group

let defaultWorld = null;

function getDefault() {
  if (!defaultWorld) {
    throw new Error('Default process group has not been initialized, please make sure to ' +
      'call initProcessGroup.');
  }
  return defaultWorld;
}

/**
 * torch's init_process_group: opts { backend: 'paramsync', initMethod: 'env://' (default) |
 * 'tcp://HOST:PORT' | 'file:///PATH' | 'unix:PATH', worldSize, rank, timeout (ms),
 * groupName (the job id) }. Job id: ?job= of the init method, else groupName, else
 * $PARAMSYNC_JOB, else the file path for file://, else "default".
 */
async function initProcessGroup(opts = {}) {
  if (typeof opts === 'string') opts = { backend: opts };
  if (opts.backend !== undefined && String(opts.backend).toLowerCase() !== 'paramsync') {
    throw new RangeError(`paramsync runs the 'paramsync' backend, not ${opts.backend}`);
  }
  if (defaultWorld) throw new Error('trying to initialize the default process group twice!');
  defaultWorld = 'initializing';
  try {
    defaultWorld = await World.init(opts);
  } catch (e) {
    defaultWorld = null;
    throw e;
  }
  return defaultWorld;
}

async function destroyProcessGroup() {
  const w = defaultWorld;
  defaultWorld = null;
  if (w && w !== 'initializing') await w.destroy();
}

function isInitialized() { return defaultWorld !== null && defaultWorld !== 'initializing'; }

const api = {
  ParamsyncError, ReduceOp, GroupMember, ProcessGroup, World, DTYPES,
  initProcessGroup, destroyProcessGroup, isInitialized,
  isAvailable: () => true,
  // The native helper loaded: collectives of a worker on its agent's host ring a doorbell.
  hasDoorbell: !!native,
  _native: native, // for the tests
};
const METHODS = ['getRank', 'getWorldSize', 'newGroup', 'newSubgroups',
  'newSubgroupsByEnumeration', 'barrier', 'monitoredBarrier', 'broadcast', 'allReduce',
  'reduce', 'allGather', 'allGatherIntoTensor', 'gather', 'scatter', 'reduceScatter',
  'reduceScatterTensor', 'allToAll', 'allToAllSingle', 'send', 'recv', 'isend', 'irecv',
  'getProcessGroupRanks', 'empty', 'free', ...OBJECT_COLLECTIVES];
const ASYNC = new Set([...COLLECTIVES, ...OBJECT_COLLECTIVES, 'newGroup', 'newSubgroups',
  'newSubgroupsByEnumeration', 'empty', 'free']);
for (const m of METHODS) {
  api[m] = ASYNC.has(m) ? (...args) => {
    try {
      return getDefault()[m](...args);
    } catch (e) {
      return Promise.reject(e);
    }
  } : (...args) => getDefault()[m](...args);
}
// Python's names too.
const snake = (s) => s.replace(/[A-Z]/g, (c) => `_${c.toLowerCase()}`);
for (const k of ['initProcessGroup', 'destroyProcessGroup', 'isInitialized', 'isAvailable',
  ...METHODS]) {
  api[snake(k)] = api[k];
}
api.reduce_op = ReduceOp;

module.exports = api;
