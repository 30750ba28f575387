# Included by _ext.pyx: torch tensors seen as NumPy arrays without a Python-level conversion.
#
# ``tensor.numpy()`` costs ~1 us per tensor (more than the decode kernel of a small layer).
# torch (2.13 here) publishes DLPack's C exchange table on its tensor type
# (``torch.Tensor.__dlpack_c_exchange_api__``, dlpack.h 1.x): one C call fills a DLTensor
# (data pointer, shape, strides, dtype, device) that borrows the tensor's own metadata. That
# call checks nothing a NumPy view needs (gradients, the negative bit, sparse or nested
# layouts: it crashes on some of these), so tensor_view reads those flags first and leaves
# anything unusual to attnfast._interop.to_numpy, which converts or raises naming the argument.
# The view's base is the tensor's storage (``untyped_storage()``), not the tensor: another
# thread's ``tensor.set_()`` swaps the tensor's storage and frees the old one when nothing else
# holds it, so a view that kept only the tensor alive would read freed memory (issue 45.10).
# Results go back the same way (array_as_tensor): a DLManagedTensorVersioned that owns a
# reference to the NumPy array, handed to the table's managed_tensor_to_py_object_no_sync
# (torch.from_numpy parses its arguments in Python, ~1 us; this is a C call).
# torch is never imported here: attnfast._interop registers the type once it has seen one.

from libc.stdint cimport int32_t, uint8_t, uint16_t, uint32_t
from cpython.pycapsule cimport PyCapsule_GetPointer
from cpython.ref cimport PyObject, Py_INCREF
from libc.stdlib cimport malloc
from cpython.exc cimport PyErr_Clear
from cpython.long cimport PyLong_FromVoidPtr
from cpython.weakref cimport PyWeakref_GetObject, PyWeakref_NewRef

cdef extern from *:
    """
    #include <stdint.h>
    /* dlpack.h 1.x, the fields attnfast reads (layouts as published by the DLPack spec) */
    typedef struct { int32_t device_type; int32_t device_id; } attnfast_DLDevice;
    typedef struct { uint8_t code; uint8_t bits; uint16_t lanes; } attnfast_DLDataType;
    typedef struct {
        void* data; attnfast_DLDevice device; int32_t ndim; attnfast_DLDataType dtype;
        int64_t* shape; int64_t* strides; uint64_t byte_offset;
    } attnfast_DLTensor;
    typedef int (*attnfast_DLTensorFromPyObject)(void* py_object, attnfast_DLTensor* out);
    typedef struct attnfast_DLManagedTensorVersioned {
        uint32_t major; uint32_t minor;            /* DLPackVersion */
        void* manager_ctx;
        void (*deleter)(struct attnfast_DLManagedTensorVersioned* self);
        uint64_t flags;
        attnfast_DLTensor dl_tensor;
    } attnfast_DLManagedTensorVersioned;
    typedef int (*attnfast_ManagedTensorToPyObject)(attnfast_DLManagedTensorVersioned* tensor,
                                                    void** out_py_object);
    typedef struct {
        uint32_t major; uint32_t minor;            /* DLPackExchangeAPIHeader.version */
        void* prev_api;
        void* managed_tensor_allocator;
        void* managed_tensor_from_py_object_no_sync;
        attnfast_ManagedTensorToPyObject managed_tensor_to_py_object_no_sync;  /* not NULL */
        attnfast_DLTensorFromPyObject dltensor_from_py_object_no_sync;  /* may be NULL */
        void* current_work_stream;
    } attnfast_DLPackExchangeAPI;

    /* The deleter of attnfast_export's tensors: drops the NumPy array they kept alive. torch
       may call it from any thread, holding the GIL or not. */
    static void attnfast_release_export(attnfast_DLManagedTensorVersioned* self) {
        PyGILState_STATE gil = PyGILState_Ensure();
        Py_XDECREF((PyObject*) self->manager_ctx);
        PyGILState_Release(gil);
        free(self);
    }

    /* A DLManagedTensorVersioned over `array` (its data, shape, strides in elements), owning
       a reference to it, in one allocation with its shape and strides; NULL when out of
       memory. */
    static attnfast_DLManagedTensorVersioned* attnfast_export(PyArrayObject* array,
                                                              uint8_t code, uint8_t bits) {
        int nd = PyArray_NDIM(array), i;
        npy_intp item = PyArray_ITEMSIZE(array);
        attnfast_DLManagedTensorVersioned* m = (attnfast_DLManagedTensorVersioned*) malloc(
            sizeof(attnfast_DLManagedTensorVersioned) + 2 * (nd ? nd : 1) * sizeof(int64_t));
        if (!m) return NULL;
        int64_t* shape = (int64_t*) (m + 1);
        int64_t* strides = shape + (nd ? nd : 1);
        for (i = 0; i < nd; ++i) {
            shape[i] = PyArray_DIMS(array)[i];
            strides[i] = PyArray_STRIDES(array)[i] / item;
        }
        m->major = 1; m->minor = 0;
        Py_INCREF((PyObject*) array);
        m->manager_ctx = array;
        m->deleter = attnfast_release_export;
        m->flags = 0;
        m->dl_tensor.data = PyArray_DATA(array);
        m->dl_tensor.device.device_type = 1;   /* kDLCPU */
        m->dl_tensor.device.device_id = 0;
        m->dl_tensor.ndim = nd;
        m->dl_tensor.dtype.code = code; m->dl_tensor.dtype.bits = bits;
        m->dl_tensor.dtype.lanes = 1;
        m->dl_tensor.shape = shape;
        m->dl_tensor.strides = strides;
        m->dl_tensor.byte_offset = 0;
        return m;
    }

    /* A new reference handed over by a C API, as the object Cython then owns. */
    static PyObject* attnfast_steal(void* new_reference) { return (PyObject*) new_reference; }
    """
    ctypedef struct attnfast_DLDevice:
        int32_t device_type
    ctypedef struct attnfast_DLDataType:
        uint8_t code
        uint8_t bits
        uint16_t lanes
    ctypedef struct attnfast_DLTensor:
        void* data
        attnfast_DLDevice device
        int32_t ndim
        attnfast_DLDataType dtype
        int64_t* shape
        int64_t* strides
        uint64_t byte_offset
    ctypedef int (*attnfast_DLTensorFromPyObject)(void* py_object, attnfast_DLTensor* out)
    ctypedef struct attnfast_DLManagedTensorVersioned:
        void (*deleter)(attnfast_DLManagedTensorVersioned* self)
    ctypedef int (*attnfast_ManagedTensorToPyObject)(attnfast_DLManagedTensorVersioned* tensor,
                                                     void** out_py_object)
    ctypedef struct attnfast_DLPackExchangeAPI:
        uint32_t major
        attnfast_ManagedTensorToPyObject managed_tensor_to_py_object_no_sync
        attnfast_DLTensorFromPyObject dltensor_from_py_object_no_sync
    attnfast_DLManagedTensorVersioned* attnfast_export(cnp.ndarray array, uint8_t code,
                                                       uint8_t bits)
    object attnfast_steal(void* new_reference)

cdef extern from *:
    """
    /* A NumPy array over foreign memory: steals the reference to descr (NumPy's rule). */
    static PyObject* attnfast_array_over(PyObject* descr, int nd, npy_intp* dims,
                                         npy_intp* strides, void* data) {
        return PyArray_NewFromDescr(&PyArray_Type, (PyArray_Descr*) descr, nd, dims, strides,
                                    data, NPY_ARRAY_WRITEABLE, NULL);
    }
    """
    object attnfast_array_over(PyObject* descr, int nd, cnp.npy_intp* dims,
                               cnp.npy_intp* strides, void* data)

cdef enum:
    _DL_CPU = 1
    _DL_INT = 0
    _DL_UINT = 1
    _DL_FLOAT = 2
    _DL_BFLOAT = 4
    _DL_BOOL = 6
    _MAX_VIEW_DIMS = 16

cdef type _ndarray = np.ndarray       # (a type test without an attribute lookup per call)
cdef object _tensor_type = None       # torch.Tensor, exactly (subclasses: the general path)
cdef object _strided = None           # torch.strided
cdef object _is_neg = None            # torch.Tensor.is_neg, called unbound
cdef object _storage_of = None        # torch.Tensor.untyped_storage, called unbound
cdef object _from_numpy = None        # torch.from_numpy
cdef const attnfast_DLPackExchangeAPI* _dl_api = NULL
cdef dict _dl_dtypes = {}             # (DLPack code, bits) -> NumPy dtype
cdef object _dl_float32 = np.dtype(np.float32)  # the common case, found without the dict


cdef inline object _dl_dtype(uint8_t code, uint8_t bits):
    if code == _DL_FLOAT and bits == 32:
        return _dl_float32
    return _dl_dtypes.get((code, bits))
cdef Py_ssize_t _views_taken = 0     # tensors tensor_view converted


def tensor_views_taken():
    """How many tensors tensor_view has converted (tests: the fast conversion is taken)."""
    return _views_taken


def register_torch(tensor_type, strided, from_numpy):
    """Let tensor_view read torch tensors (attnfast._interop calls this once it has seen one).
    Returns whether torch publishes a usable DLPack C exchange table (else tensor_view returns
    None and the callers fall back to ``tensor.numpy()``)."""
    global _tensor_type, _strided, _is_neg, _dl_api, _from_numpy, _storage_of
    cdef const attnfast_DLPackExchangeAPI* api = NULL
    capsule = getattr(tensor_type, "__dlpack_c_exchange_api__", None)
    if capsule is not None:
        try:
            api = <const attnfast_DLPackExchangeAPI*> PyCapsule_GetPointer(
                capsule, b"dlpack_exchange_api")
        except (TypeError, ValueError):
            api = NULL
    if api != NULL and (api.major != 1 or api.dltensor_from_py_object_no_sync == NULL
                        or api.managed_tensor_to_py_object_no_sync == NULL):
        api = NULL      # another major version: its layout may differ
    _tensor_type, _strided, _is_neg, _dl_api = tensor_type, strided, tensor_type.is_neg, api
    _storage_of = tensor_type.untyped_storage
    _from_numpy = from_numpy
    if not _dl_dtypes:
        for code, bits, name in ((_DL_FLOAT, 32, "float32"), (_DL_FLOAT, 64, "float64"),
                                 (_DL_FLOAT, 16, "float16"), (_DL_INT, 64, "int64"),
                                 (_DL_INT, 32, "int32"), (_DL_INT, 16, "int16"),
                                 (_DL_INT, 8, "int8"), (_DL_UINT, 8, "uint8"),
                                 (_DL_BOOL, 8, "bool")):
            _dl_dtypes[(code, bits)] = np.dtype(name)
        _dl_dtypes[(_DL_BFLOAT, 16)] = _BFLOAT16
    return api != NULL


def tensor_view(t):
    """A writeable NumPy array viewing the memory of `t`, as ``t.numpy()`` gives (bfloat16 as
    ml_dtypes.bfloat16), or None when `t` is not exactly a torch.Tensor that is dense, on the
    CPU, without grad or the negative bit, of a real or bool dtype (the caller then converts
    it the general way, which explains a refusal). Its base is `t`'s storage
    (``t.untyped_storage()``): the memory stays valid for as long as the view lives, even if
    another thread gives `t` other storage meanwhile (``t.set_()``)."""
    return _view_of(t)


# Tensors converted again (the caches, out buffers and lengths a model passes every step)
# keep their view: a repeat conversion then asks torch only what can change in place
# (requires_grad, the negative bit through ``.data =``) and DLPack the data pointer, shape,
# strides, dtype and device, all compared with the view's. The view holds the storage it
# was made over (see above), so the memory it reads stays valid even if the tensor was
# given other storage meanwhile (then the pointers differ and a new view replaces it). A
# tensor is remembered on its second conversion (one-off tensors such as a step's q cost
# one set lookup), forgotten when it is freed (a weak reference's callback), at most
# _VIEWS_KEPT at a time.
cdef enum:
    _VIEWS_KEPT = 256
cdef dict _kept_views = {}            # id(tensor) -> _KeptView
cdef set _converted_once = set()      # ids of tensors converted once (bounded: cleared)


cdef class _KeptView:
    """A tensor's view (_view_of) and a weak reference to the tensor."""
    cdef object ref, view


cdef class _Forget:
    """The callback of a _KeptView's weak reference: the freed tensor's entry goes."""
    cdef object key

    def __call__(self, ref):
        kept = _kept_views.get(self.key)
        if kept is not None and (<_KeptView> kept).ref is ref:
            del _kept_views[self.key]


cdef bint _dl_layout(attnfast_DLTensor* dl, cnp.npy_intp item, cnp.npy_intp* dims,
                     cnp.npy_intp* strides):
    """dl's shape and strides (in bytes) into dims, strides; False unless it is a CPU tensor
    of at most _MAX_VIEW_DIMS axes."""
    cdef cnp.npy_intp step = item
    cdef int i
    if (dl.device.device_type != _DL_CPU or dl.dtype.lanes != 1 or dl.ndim < 0
            or dl.ndim > _MAX_VIEW_DIMS):
        return False
    for i in range(dl.ndim - 1, -1, -1):
        dims[i] = dl.shape[i]
        if dl.strides != NULL:
            strides[i] = dl.strides[i] * item
        else:            # compact row-major (DLPack's convention for NULL strides)
            strides[i] = step
            step *= dl.shape[i]
    return True


cdef object _kept_view(t, key):
    """The view kept for `t` if the tensor still has its layout and memory; else None."""
    cdef _KeptView kept = _kept_views.get(key)
    cdef attnfast_DLTensor dl
    cdef cnp.ndarray view
    cdef cnp.npy_intp dims[_MAX_VIEW_DIMS]
    cdef cnp.npy_intp strides[_MAX_VIEW_DIMS]
    cdef int i
    if kept is None or PyWeakref_GetObject(kept.ref) != <PyObject*> t:
        return None
    if _dl_api.dltensor_from_py_object_no_sync(<void*> t, &dl) != 0:
        PyErr_Clear()
        return None
    view = <cnp.ndarray> kept.view
    descr = _dl_dtype(dl.dtype.code, dl.dtype.bits)
    if ((<char*> dl.data) + dl.byte_offset != <char*> cnp.PyArray_DATA(view)
            or dl.ndim != cnp.PyArray_NDIM(view)
            or <void*> descr != <void*> cnp.PyArray_DESCR(view)
            or not _dl_layout(&dl, cnp.PyArray_ITEMSIZE(view), dims, strides)):
        return None
    for i in range(dl.ndim):
        if dims[i] != cnp.PyArray_DIMS(view)[i] or strides[i] != cnp.PyArray_STRIDES(view)[i]:
            return None
    return view


cdef object _view_of(t):
    """tensor_view."""
    cdef attnfast_DLTensor dl
    cdef char* data
    cdef cnp.npy_intp dims[_MAX_VIEW_DIMS]
    cdef cnp.npy_intp strides[_MAX_VIEW_DIMS]
    cdef _KeptView kept
    cdef _Forget forget
    global _views_taken
    if _dl_api == NULL or type(t) is not _tensor_type:
        return None
    if t.requires_grad or _is_neg(t):
        return None
    key = PyLong_FromVoidPtr(<void*> t)
    view = _kept_view(t, key)
    if view is not None:
        _views_taken += 1
        return view
    if not t.is_cpu or t.layout is not _strided or t.is_nested:
        return None
    if _dl_api.dltensor_from_py_object_no_sync(<void*> t, &dl) != 0:
        PyErr_Clear()
        return None
    data = (<char*> dl.data) + dl.byte_offset
    # What keeps the memory valid: the storage, taken between two reads of the data pointer
    # that must agree (another thread's set_() in between: the general path instead).
    try:
        storage = _storage_of(t)
    except Exception:  # a tensor without a storage of its own: the general path decides
        return None
    if _dl_api.dltensor_from_py_object_no_sync(<void*> t, &dl) != 0:
        PyErr_Clear()
        return None
    if (<char*> dl.data) + dl.byte_offset != data:
        return None
    descr = _dl_dtype(dl.dtype.code, dl.dtype.bits)
    if descr is None or not _dl_layout(&dl, (<cnp.dtype> descr).itemsize, dims, strides):
        return None
    Py_INCREF(descr)
    view = attnfast_array_over(<PyObject*> descr, dl.ndim, dims, strides, data)
    cnp.set_array_base(view, storage)
    _views_taken += 1
    if key in _converted_once or key in _kept_views:  # converted before: kept
        if len(_kept_views) >= _VIEWS_KEPT:
            _kept_views.clear()
        forget = _Forget.__new__(_Forget)
        forget.key = key
        kept = _KeptView.__new__(_KeptView)
        kept.view, kept.ref = view, PyWeakref_NewRef(t, forget)
        _kept_views[key] = kept
    else:
        if len(_converted_once) >= 16 * _VIEWS_KEPT:
            _converted_once.clear()
        _converted_once.add(key)
    return view


def array_as_tensor(a):
    """A torch tensor sharing the memory of `a` (keeping `a` alive), as ``torch.from_numpy(a)``
    gives, for a writeable ndarray whose strides are whole elements, of a dtype torch takes
    (float32 / 64 / 16, bfloat16, int64 / 32 / 8, bool); None otherwise, or before
    register_torch (attnfast._interop.wrap_like then converts it the general way)."""
    cdef int num, i
    cdef uint8_t code, bits
    cdef cnp.ndarray arr
    cdef attnfast_DLManagedTensorVersioned* managed
    cdef void* tensor = NULL
    if _dl_api == NULL or type(a) is not _ndarray:
        return None
    arr = <cnp.ndarray> a
    if not (cnp.PyArray_FLAGS(arr) & cnp.NPY_ARRAY_WRITEABLE) or cnp.PyArray_ISBYTESWAPPED(arr):
        return None
    num = cnp.PyArray_TYPE(arr)
    if num == cnp.NPY_FLOAT32:
        code, bits = _DL_FLOAT, 32
    elif num == cnp.NPY_FLOAT64:
        code, bits = _DL_FLOAT, 64
    elif num == cnp.NPY_FLOAT16:
        code, bits = _DL_FLOAT, 16
    elif num == cnp.NPY_INT64:
        code, bits = _DL_INT, 64
    elif num == cnp.NPY_INT32:
        code, bits = _DL_INT, 32
    elif num == cnp.NPY_INT8:
        code, bits = _DL_INT, 8
    elif num == cnp.NPY_BOOL:
        code, bits = _DL_BOOL, 8
    elif num == (<cnp.dtype> _BFLOAT16).type_num:
        code, bits = _DL_BFLOAT, 16
    else:
        return None
    for i in range(cnp.PyArray_NDIM(arr)):
        if cnp.PyArray_STRIDES(arr)[i] % cnp.PyArray_ITEMSIZE(arr):
            return None
    managed = attnfast_export(arr, code, bits)
    if managed == NULL:
        raise MemoryError()
    if _dl_api.managed_tensor_to_py_object_no_sync(managed, &tensor) != 0:
        # Whether the producer freed `managed` before failing is not specified: it is left
        # (at worst one array stays alive) rather than risk freeing it twice. The general
        # path (torch.from_numpy) then runs and raises what is wrong, if anything.
        PyErr_Clear()
        return None
    return attnfast_steal(tensor)


cdef bint _all_ints(items):
    """Every item of a list or tuple is exactly an int (seq_ids, window: nothing to convert)."""
    cdef Py_ssize_t i
    for i in range(len(items)):
        if type(items[i]) is not int:
            return False
    return True


cdef inline bint _plain(a) noexcept:
    """An argument accepts_arrays passes on as it is (no tensor or array-like to convert)."""
    t = type(a)
    return (a is None or t is _ndarray or t is int or t is float or t is bool or t is str
            or ((t is list or t is tuple) and _all_ints(a)))


cdef class Converting:
    """attnfast._interop.accepts_arrays' conversions around `fn` (parameter names `names`;
    `out` at out_index, -1 without), as accepts_arrays describes them: arguments from index
    `first` on that are not plain (_plain) become NumPy views in C (_view_of) or by
    ``convert(argument, name)`` -> (converted, the torch tensor or None); with a torch
    tensor among them, the result's arrays become tensors (array_as_tensor, or ``wrap(result,
    tensor)``) and `out` comes back as the object passed. Called by converting's wrapper,
    or inside a transaction (attnfast._transaction)."""
    cdef object fn, convert, wrap
    cdef tuple names
    cdef Py_ssize_t first, out_index

    def __init__(self, fn, tuple names, Py_ssize_t first, Py_ssize_t out_index, convert, wrap):
        self.fn, self.names, self.first, self.out_index = fn, names, first, out_index
        self.convert, self.wrap = convert, wrap

    cdef object call(self, tuple args, dict kwargs):
        cdef Py_ssize_t i, first = self.first, out_index = self.out_index
        cdef list new_args = None
        cdef dict new_kwargs = None
        template = given_out = converted_out = None
        for i in range(first, len(args)):
            a = args[i]
            if _plain(a):
                continue
            view = _view_of(a)
            t = a
            if view is None:
                view, t = self.convert(a, self.names[i] if i < len(self.names)
                                       else f"argument {i}")
            if new_args is None:
                new_args = list(args)
            new_args[i] = view
            if template is None:
                template = t
            if i == out_index:
                given_out, converted_out = a, view
        for name, a in kwargs.items():
            if _plain(a):
                continue
            view = _view_of(a)
            t = a
            if view is None:
                view, t = self.convert(a, name)
            if new_kwargs is None:
                new_kwargs = dict(kwargs)
            new_kwargs[name] = view
            if template is None:
                template = t
            if name == "out":
                given_out, converted_out = a, view
        if new_args is not None:
            args = tuple(new_args)
        result = self.fn(*args, **(kwargs if new_kwargs is None else new_kwargs))
        if template is None:
            return result
        if given_out is None:  # a NumPy out= (not converted) comes back as itself too
            given_out = converted_out = (args[out_index] if 0 <= out_index < len(args)
                                         else kwargs.get("out"))
        if type(result) is tuple:  # (out, lse): each converted once (out not at all if given)
            return tuple([given_out if given_out is not None and r is converted_out
                          else _as_tensor(r, template, self.wrap) for r in <tuple> result])
        if given_out is not None and result is converted_out:
            return given_out
        return _as_tensor(result, template, self.wrap)


def converting(Converting conversions):
    """The function that calls `conversions` (accepts_arrays' wrapper)."""
    def call(*args, **kwargs):
        return conversions.call(args, kwargs)
    return call


cdef object _as_tensor(result, template, wrap):
    """wrap(result, template) (attnfast._interop.wrap_like), its common case (an array) in C."""
    tensor = array_as_tensor(result)
    return tensor if tensor is not None else wrap(result, template)
