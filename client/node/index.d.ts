// Types of the paramsync Node.js client (index.js). Tensors are typed arrays;
// float16/bfloat16 travel in a Uint16Array with { dtype }, bool in a Uint8Array.
export type Tensor = Float32Array | Float64Array | Int8Array | Uint8Array | Int16Array |
  Int32Array | BigInt64Array | Uint16Array;
export type DType = 'float32' | 'float64' | 'float16' | 'bfloat16' | 'int8' | 'uint8' |
  'int16' | 'int32' | 'int64' | 'bool';
export declare const ReduceOp: Readonly<{ SUM: 0; PRODUCT: 1; MIN: 2; MAX: 3; BAND: 4;
  BOR: 5; BXOR: 6; AVG: 7 }>;
export declare const DTYPES: Readonly<Record<DType, number>>;
export declare class ParamsyncError extends Error {
  code: number; codeName: string; details: string;
}
export declare class ProcessGroup { readonly id: number; readonly ranks: number[];
  rank(): number; size(): number; }
export declare const GroupMember: { readonly WORLD: object; readonly NON_GROUP_MEMBER: object };
export type Group = ProcessGroup | typeof GroupMember.WORLD | typeof GroupMember.NON_GROUP_MEMBER;
export interface InitOptions { backend?: 'paramsync'; initMethod?: string; worldSize?: number;
  rank?: number; timeout?: number; groupName?: string }
export interface Opts { group?: Group; dtype?: DType }
export interface ReduceOpts extends Opts { op?: number }
export interface P2POpts extends Opts { tag?: number }
export interface AllToAllOpts extends Opts { outputSplitSizes?: number[];
  inputSplitSizes?: number[] }

export declare class World {
  static init(opts?: InitOptions): Promise<World>;
  readonly rank: number; readonly size: number; readonly job: string;
  /** Collectives answered through a doorbell (no gRPC call) so far. */
  readonly doorbellRung: number;
  /** Of them, those answered while the event loop's thread waited for the answer
   * ($PARAMSYNC_NODE_WAIT_NOW_US, where the collective was the only one in flight). */
  readonly doorbellAnsweredNow: number;
  /** Barriers met on the ranks' shared page (direct barriers) while the event loop's
   * thread waited ($PARAMSYNC_NODE_WAIT_NOW_US, the only collective in flight). */
  readonly barrierMetNow: number;
  /** Collectives that went rank to rank by peer copies so far. */
  readonly peerUsed: number;
  destroy(): Promise<void>;
  abort(): void;
  newGroup(ranks?: number[]): Promise<Group>;
  /** [this rank's group, all of them]: the world in groups of groupSize consecutive ranks. */
  newSubgroups(groupSize: number): Promise<[Group, Group[]]>;
  /** [this rank's group or null, all of them]: a group for each array of ranks. */
  newSubgroupsByEnumeration(rankLists: number[][]): Promise<[Group | null, Group[]]>;
  getRank(group?: Group): number;
  getWorldSize(group?: Group): number;
  getProcessGroupRanks(group?: Group): number[];
  /** count elements of dtype in memory the agent uses in place (Python's empty()). */
  empty(count: number, dtype?: string): Promise<Tensor>;
  /** Gives an array from empty() back to the agent. */
  free(tensor: Tensor): Promise<void>;
  barrier(opts?: Opts): Promise<void>;
  /** A barrier with a deadline of its own (timeout, ms): a rank missing by then fails it on
   * every rank that came, DEADLINE_EXCEEDED naming every missing rank. */
  monitoredBarrier(opts?: { group?: Group; timeout?: number }): Promise<void>;
  broadcast<T extends Tensor>(tensor: T, src: number, opts?: Opts): Promise<T>;
  allReduce<T extends Tensor>(tensor: T, opts?: ReduceOpts): Promise<T>;
  reduce<T extends Tensor>(tensor: T, dst: number, opts?: ReduceOpts): Promise<T>;
  allGather(tensorList: Tensor[], tensor: Tensor, opts?: Opts): Promise<Tensor[]>;
  allGatherIntoTensor<T extends Tensor>(output: T, input: Tensor, opts?: Opts): Promise<T>;
  gather(tensor: Tensor, gatherList?: Tensor[] | null, dst?: number, opts?: Opts):
    Promise<Tensor[] | null>;
  scatter<T extends Tensor>(tensor: T, scatterList?: Tensor[] | null, src?: number,
    opts?: Opts): Promise<T>;
  reduceScatter<T extends Tensor>(output: T, inputList: Tensor[], opts?: ReduceOpts): Promise<T>;
  reduceScatterTensor<T extends Tensor>(output: T, input: Tensor, opts?: ReduceOpts): Promise<T>;
  allToAll(outputList: Tensor[], inputList: Tensor[], opts?: Opts): Promise<Tensor[]>;
  /** Uneven with split sizes (elements per rank; every rank gives them or none does): two
   * collectives, so another on the group may start once it resolves. */
  allToAllSingle<T extends Tensor>(output: T, input: Tensor, opts?: AllToAllOpts): Promise<T>;
  /** torch's object collectives: objects go serialized by v8.serialize (structured
   * clone); each resolves to the list it filled in place (gatherObject: null on ranks
   * other than dst). Another collective on the group may start once it resolves. */
  allGatherObject(objectList: unknown[], obj: unknown, opts?: Opts): Promise<unknown[]>;
  gatherObject(obj: unknown, objectGatherList?: unknown[] | null, dst?: number,
    opts?: Opts): Promise<unknown[] | null>;
  broadcastObjectList(objectList: unknown[], src?: number, opts?: Opts): Promise<unknown[]>;
  scatterObjectList(outputList: unknown[], inputList?: unknown[] | null, src?: number,
    opts?: Opts): Promise<unknown[]>;
  send(tensor: Tensor, dst: number, opts?: P2POpts): Promise<void>;
  recv(tensor: Tensor, src?: number | null, opts?: P2POpts): Promise<number>;
  isend(tensor: Tensor, dst: number, opts?: P2POpts): Promise<void>;
  irecv(tensor: Tensor, src?: number | null, opts?: P2POpts): Promise<number>;
}

export declare function initProcessGroup(opts?: InitOptions | 'paramsync'): Promise<World>;
export declare function destroyProcessGroup(): Promise<void>;
export declare function isInitialized(): boolean;
export declare function isAvailable(): boolean;
/** The native helper (paramsync_node.node) loaded: collectives of a worker on its agent's
 * host go without a gRPC call. */
export declare const hasDoorbell: boolean;
export declare const getRank: World['getRank'];
export declare const getWorldSize: World['getWorldSize'];
export declare const newGroup: World['newGroup'];
export declare const newSubgroups: World['newSubgroups'];
export declare const newSubgroupsByEnumeration: World['newSubgroupsByEnumeration'];
export declare const barrier: World['barrier'];
export declare const monitoredBarrier: World['monitoredBarrier'];
export declare const broadcast: World['broadcast'];
export declare const allReduce: World['allReduce'];
export declare const reduce: World['reduce'];
export declare const allGather: World['allGather'];
export declare const allGatherIntoTensor: World['allGatherIntoTensor'];
export declare const gather: World['gather'];
export declare const scatter: World['scatter'];
export declare const reduceScatter: World['reduceScatter'];
export declare const reduceScatterTensor: World['reduceScatterTensor'];
export declare const allToAll: World['allToAll'];
export declare const allToAllSingle: World['allToAllSingle'];
export declare const allGatherObject: World['allGatherObject'];
export declare const gatherObject: World['gatherObject'];
export declare const broadcastObjectList: World['broadcastObjectList'];
export declare const scatterObjectList: World['scatterObjectList'];
export declare const send: World['send'];
export declare const recv: World['recv'];
export declare const isend: World['isend'];
export declare const irecv: World['irecv'];
export declare const getProcessGroupRanks: World['getProcessGroupRanks'];
export declare const empty: World['empty'];
export declare const free: World['free'];
// Python's snake_case names are exported as aliases too (all_reduce, init_process_group, ...).
