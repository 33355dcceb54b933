// Host-side checks of libdflash_kv_inject_plugin.so, without TensorRT's libraries and without a GPU:
//
//   test_plugin_host <path to libdflash_kv_inject_plugin.so>
//
// It dlopens the library, takes the creator from its `getCreators` entry point (as IPluginRegistry::loadLibrary
// does), installs a recording logger through `setLoggerFinder`, and calls the plugin's methods as TensorRT's builder
// and runtime would: names, fields (eps, alias_cache), output types and shapes, the format combinations, aliasing,
// shape checks, serialisation round trip, clone, attachToContext with an error recorder (and a clone of the attached
// plugin without it), and enqueue's paths that return before the GPU (a bad shape; zero tokens in place; without a
// GPU, the CUDA failure reported as kFAILED_EXECUTION). Prints one "ok <check>" line per check and "ALL OK <n>
// checks", or "FAIL <check>: <detail>" and exits 1. Built and run by tests/plugins/test_trt_plugin.py.
//
//   test_plugin_host <library> --gpu
//
// additionally runs enqueue on a CUDA GPU (float32, in place and into a separate output) against a float32 reference
// computed here, and checks that out-of-range rows and positions are skipped without an error; not run by the test
// suite on a machine without a GPU.
#include <NvInferRuntime.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

using namespace nvinfer1;

namespace {

int gChecks = 0;

void expect(bool ok, char const* what, std::string const& detail = "") {
  if (!ok) {
    std::printf("FAIL %s: %s\n", what, detail.c_str());
    std::exit(1);
  }
  ++gChecks;
  std::printf("ok %s\n", what);
}

// Logger and finder as TensorRT would pass them to setLoggerFinder; keeps the last message.
struct RecordingLogger : ILogger {
  std::string last;
  void log(Severity, AsciiChar const* msg) noexcept override { last = msg; }
};
struct Finder : ILoggerFinder {
  RecordingLogger logger;
  ILogger* findLogger() override { return &logger; }
};
Finder gFinder;

std::string take_log() {
  std::string s = gFinder.logger.last;
  gFinder.logger.last.clear();
  return s;
}

// The plugin logged a message containing `needle` (and the log is cleared).
bool logged(char const* needle) { return take_log().find(needle) != std::string::npos; }

char const* type_name(DataType t) {
  return t == DataType::kFLOAT ? "float32" : t == DataType::kHALF ? "float16" : "bfloat16";
}

struct Recorder : IErrorRecorder {
  std::string last;
  ErrorCode lastCode = ErrorCode::kSUCCESS;
  int32_t count = 0;
  int32_t getNbErrors() const noexcept override { return count; }
  ErrorCode getErrorCode(int32_t) const noexcept override { return lastCode; }
  ErrorDesc getErrorDesc(int32_t) const noexcept override { return last.c_str(); }
  bool hasOverflowed() const noexcept override { return false; }
  void clear() noexcept override {
    count = 0;
    last.clear();
    lastCode = ErrorCode::kSUCCESS;
  }
  bool reportError(ErrorCode code, ErrorDesc desc) noexcept override {
    ++count;
    last = desc;
    lastCode = code;
    return false;
  }
  RefCount incRefCount() noexcept override { return 1; }
  RefCount decRefCount() noexcept override { return 0; }
};

struct ResourceContext : IPluginResourceContext {
  Recorder* recorder;
  explicit ResourceContext(Recorder* r) : recorder(r) {}
  IGpuAllocator* getGpuAllocator() const noexcept override { return nullptr; }
  IErrorRecorder* getErrorRecorder() const noexcept override { return recorder; }
};

Dims dims(std::vector<int64_t> v) {
  Dims d{};
  d.nbDims = static_cast<int32_t>(v.size());
  for (size_t i = 0; i < v.size(); ++i) d.d[i] = v[i];
  return d;
}

// A problem: n sequences of c tokens, L layers, B cache rows, H KV heads, cap slots, head_dim D.
struct Shape {
  int64_t n = 2, c = 3, L = 2, B = 4, H = 2, cap = 16, D = 8;
  std::vector<Dims> inputs() const {
    return {dims({n, c, L * 2 * H * D}), dims({L, D}), dims({n, c, D}), dims({n, c, D}),
            dims({2, L, B, H, cap, D}), dims({n}), dims({n, c})};
  }
};

std::vector<PluginTensorDesc> descs(std::vector<Dims> const& in, DataType t) {
  DataType const types[7] = {t, t, DataType::kFLOAT, DataType::kFLOAT, t, DataType::kINT64, DataType::kINT64};
  std::vector<PluginTensorDesc> d(8);
  for (int i = 0; i < 8; ++i) {
    d[i].dims = i < 7 ? in[i] : in[4];
    d[i].type = i < 7 ? types[i] : t;
    d[i].format = TensorFormat::kLINEAR;
    d[i].scale = -1.0f;
  }
  return d;
}

std::vector<DynamicPluginTensorDesc> dynamic(std::vector<PluginTensorDesc> const& d) {
  std::vector<DynamicPluginTensorDesc> out(d.size());
  for (size_t i = 0; i < d.size(); ++i) {
    out[i].desc = d[i];
    out[i].min = out[i].max = out[i].opt = d[i].dims;
  }
  return out;
}

bool accepts_all(IPluginV3OneBuild* b, std::vector<DynamicPluginTensorDesc> const& d) {
  for (int32_t pos = 0; pos < 8; ++pos)
    if (!b->supportsFormatCombination(pos, d.data(), 7, 1)) return false;
  return true;
}

// The serialised field `name` of type `type` (one value), nullptr unless getFieldsToSerialize has exactly eps then
// alias_cache.
void const* serialised(IPluginV3* p, char const* name, PluginFieldType type) {
  auto* rt = static_cast<IPluginV3OneRuntime*>(p->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
  PluginFieldCollection const* fc = rt->getFieldsToSerialize();
  if (fc == nullptr || fc->nbFields != 2 || std::strcmp(fc->fields[0].name, "eps") != 0 ||
      std::strcmp(fc->fields[1].name, "alias_cache") != 0)
    return nullptr;
  for (int32_t i = 0; i < 2; ++i)
    if (std::strcmp(fc->fields[i].name, name) == 0 && fc->fields[i].type == type && fc->fields[i].length == 1)
      return fc->fields[i].data;
  return nullptr;
}
float eps_of(IPluginV3* p) {
  void const* v = serialised(p, "eps", PluginFieldType::kFLOAT32);
  return v != nullptr ? *static_cast<float const*>(v) : NAN;
}
int32_t alias_of(IPluginV3* p) {
  void const* v = serialised(p, "alias_cache", PluginFieldType::kINT32);
  return v != nullptr ? *static_cast<int32_t const*>(v) : -99;
}
// getAliasedInput(0) of p's build capability.
int32_t aliased_input(IPluginV3* p) {
  return static_cast<IPluginV3OneBuildV2*>(p->getCapabilityInterface(PluginCapabilityType::kBUILD))
      ->getAliasedInput(0);
}

IPluginV3* create(IPluginCreatorV3One* creator, std::vector<PluginField> const& fields, TensorRTPhase phase) {
  PluginFieldCollection fc{static_cast<int32_t>(fields.size()), fields.data()};
  return creator->createPlugin("kv_inject", &fc, phase);
}

// enqueue on a GPU (float32) against a host reference of kv_inject.cu's math, in place and into a separate output.
void gpu_checks(IPluginV3* plugin, float eps) {
  Shape s;
  auto* rt = static_cast<IPluginV3OneRuntime*>(plugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
  int64_t const tokens = s.n * s.c, width = s.L * 2 * s.H * s.D, half = s.D / 2;
  int64_t const cache_size = 2 * s.L * s.B * s.H * s.cap * s.D;
  std::vector<float> kv(tokens * width), w(s.L * s.D), cs(tokens * s.D), sn(tokens * s.D), cache(cache_size);
  for (size_t i = 0; i < kv.size(); ++i) kv[i] = std::sin(0.37f * static_cast<float>(i) + 1.0f);
  for (size_t i = 0; i < w.size(); ++i) w[i] = 0.5f + 0.01f * static_cast<float>(i);
  for (size_t i = 0; i < cs.size(); ++i) {
    cs[i] = std::cos(0.1f * static_cast<float>(i));
    sn[i] = std::sin(0.1f * static_cast<float>(i));
  }
  for (size_t i = 0; i < cache.size(); ++i) cache[i] = -7.0f;
  std::vector<int64_t> rows = {3, 1}, pos = {0, 5, 9, 2, 3, 15};
  std::vector<float> want = cache;  // the reference
  for (int64_t i = 0; i < tokens; ++i)
    for (int64_t l = 0; l < s.L; ++l)
      for (int64_t h = 0; h < s.H; ++h) {
        float const* k = &kv[i * width + l * 2 * s.H * s.D + h * s.D];
        float const* v = k + s.H * s.D;
        float ss = 0.0f;
        for (int64_t d = 0; d < s.D; ++d) ss += k[d] * k[d];
        float const inv = 1.0f / std::sqrt(ss / static_cast<float>(s.D) + eps);
        int64_t const base = l * s.B * s.H * s.cap * s.D + rows[i / s.c] * s.H * s.cap * s.D + h * s.cap * s.D +
                             pos[i] * s.D;
        for (int64_t d = 0; d < half; ++d) {
          float const a = w[l * s.D + d] * (k[d] * inv), b = w[l * s.D + d + half] * (k[d + half] * inv);
          want[base + d] = a * cs[i * s.D + d] - b * sn[i * s.D + d];
          want[base + d + half] = b * cs[i * s.D + d + half] + a * sn[i * s.D + d + half];
        }
        for (int64_t d = 0; d < s.D; ++d) want[cache_size / 2 + base + d] = v[d];
      }
  auto upload = [](void const* src, size_t bytes) {
    void* p = nullptr;
    cudaMalloc(&p, bytes);
    cudaMemcpy(p, src, bytes, cudaMemcpyHostToDevice);
    return p;
  };
  void* in[7] = {upload(kv.data(), kv.size() * 4), upload(w.data(), w.size() * 4), upload(cs.data(), cs.size() * 4),
                 upload(sn.data(), sn.size() * 4), upload(cache.data(), cache.size() * 4),
                 upload(rows.data(), rows.size() * 8), upload(pos.data(), pos.size() * 8)};
  void* separate = nullptr;
  cudaMalloc(&separate, cache.size() * 4);
  auto d = descs(s.inputs(), DataType::kFLOAT);
  cudaStream_t stream = nullptr;
  cudaStreamCreate(&stream);
  for (int aliased = 1; aliased >= 0; --aliased) {
    cudaMemcpy(in[4], cache.data(), cache.size() * 4, cudaMemcpyHostToDevice);
    void* out[1] = {aliased ? in[4] : separate};
    int32_t const rc = rt->enqueue(d.data(), d.data() + 7, in, out, nullptr, stream);
    cudaError_t const sync = cudaStreamSynchronize(stream);
    std::vector<float> got(cache.size());
    cudaMemcpy(got.data(), out[0], got.size() * 4, cudaMemcpyDeviceToHost);
    double worst = 0.0;
    for (size_t i = 0; i < got.size(); ++i) worst = std::fmax(worst, std::fabs(got[i] - want[i]));
    char const* what = aliased ? "gpu: enqueue in place matches the float32 reference"
                               : "gpu: enqueue into a separate output matches the reference";
    expect(rc == 0 && sync == cudaSuccess && worst < 1e-5, what,
           "rc " + std::to_string(rc) + ", " + cudaGetErrorString(sync) + ", max error " + std::to_string(worst));
  }
  std::vector<float> untouched(cache.size());
  cudaMemcpy(untouched.data(), in[4], untouched.size() * 4, cudaMemcpyDeviceToHost);
  expect(untouched == cache, "gpu: a separate output leaves the cache input untouched");
  {
    // Sequence 1's row (B) and two positions of sequence 0 (cap, -1) outside the cache: those tokens are skipped, the
    // others written as in the reference, and no device-side assertion (the context stays usable).
    std::vector<int64_t> bad_rows = {3, s.B}, bad_pos = {0, s.cap, -1, 2, 3, 15};
    cudaMemcpy(in[5], bad_rows.data(), bad_rows.size() * 8, cudaMemcpyHostToDevice);
    cudaMemcpy(in[6], bad_pos.data(), bad_pos.size() * 8, cudaMemcpyHostToDevice);
    cudaMemcpy(in[4], cache.data(), cache.size() * 4, cudaMemcpyHostToDevice);
    void* out[1] = {in[4]};
    int32_t const rc = rt->enqueue(d.data(), d.data() + 7, in, out, nullptr, stream);
    cudaError_t const sync = cudaStreamSynchronize(stream);
    std::vector<float> got(cache.size());
    cudaMemcpy(got.data(), in[4], got.size() * 4, cudaMemcpyDeviceToHost);
    // only token 0 (row 3, position 0) is in range: the reference's writes at that slot, the initial cache elsewhere
    std::vector<float> want0 = cache;
    for (int64_t kvi = 0; kvi < 2; ++kvi)
      for (int64_t l = 0; l < s.L; ++l)
        for (int64_t h = 0; h < s.H; ++h)
          for (int64_t e = 0; e < s.D; ++e) {
            int64_t const at = kvi * (cache_size / 2) + l * s.B * s.H * s.cap * s.D + 3 * s.H * s.cap * s.D +
                               h * s.cap * s.D + 0 * s.D + e;
            want0[at] = want[at];
          }
    double worst = 0.0;
    for (size_t i = 0; i < got.size(); ++i) worst = std::fmax(worst, std::fabs(got[i] - want0[i]));
    expect(rc == 0 && sync == cudaSuccess && worst < 1e-5,
           "gpu: rows and positions outside the cache are skipped, no device-side assertion",
           "rc " + std::to_string(rc) + ", " + cudaGetErrorString(sync) + ", max error " + std::to_string(worst));
  }
  for (void* p : in) cudaFree(p);
  cudaFree(separate);
  cudaStreamDestroy(stream);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s <libdflash_kv_inject_plugin.so> [--gpu]\n", argv[0]);
    return 2;
  }
  bool const gpu = argc > 2 && std::strcmp(argv[2], "--gpu") == 0;
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  expect(lib != nullptr, "dlopen", lib ? "" : dlerror());

  // The two entry points IPluginRegistry::loadLibrary looks up.
  using GetCreators = IPluginCreatorInterface* const* (*)(int32_t&);
  using SetLoggerFinder = void (*)(ILoggerFinder*);
  auto get_creators = reinterpret_cast<GetCreators>(dlsym(lib, "getCreators"));
  auto set_logger_finder = reinterpret_cast<SetLoggerFinder>(dlsym(lib, "setLoggerFinder"));
  expect(get_creators != nullptr && set_logger_finder != nullptr, "exports getCreators and setLoggerFinder");
  expect(dlsym(lib, "dflash_kv_inject") == nullptr && dlsym(lib, "dflash_kv_inject_guarded") == nullptr,
         "the kernel's C ABI stays internal (hidden visibility)");
  set_logger_finder(&gFinder);
  int32_t nb = -1;
  IPluginCreatorInterface* const* creators = get_creators(nb);
  expect(nb == 1 && creators != nullptr && creators[0] != nullptr, "getCreators returns one creator");
  InterfaceInfo const info = creators[0]->getInterfaceInfo();
  expect(std::strcmp(info.kind, "PLUGIN CREATOR_V3ONE") == 0 && info.major == 1,
         "the creator is an IPluginCreatorV3One", info.kind);
  auto* creator = static_cast<IPluginCreatorV3One*>(creators[0]);
  expect(std::strcmp(creator->getPluginName(), "DFlashKVInject") == 0 &&
             std::strcmp(creator->getPluginVersion(), "1") == 0 &&
             std::strcmp(creator->getPluginNamespace(), "dflash_trt") == 0,
         "creator name / version / namespace");
  PluginFieldCollection const* names = creator->getFieldNames();
  expect(names != nullptr && names->nbFields == 2 && std::strcmp(names->fields[0].name, "eps") == 0 &&
             names->fields[0].type == PluginFieldType::kFLOAT32 &&
             std::strcmp(names->fields[1].name, "alias_cache") == 0 &&
             names->fields[1].type == PluginFieldType::kINT32,
         "getFieldNames lists eps (kFLOAT32) and alias_cache (kINT32)");

  // Fields: eps required, one finite kFLOAT32 > 0; anything else refused with a message.
  float const eps = 1e-5f;
  double const eps64 = 1e-5;
  float const two[2] = {1e-5f, 1e-6f}, zero = 0.0f, nan = NAN;
  TensorRTPhase const kB = TensorRTPhase::kBUILD;
  PluginField const eps_field("eps", &eps, PluginFieldType::kFLOAT32, 1);
  expect(creator->createPlugin("kv", nullptr, kB) == nullptr && logged("missing field eps"),
         "no field collection: refused, 'missing field eps'");
  expect(create(creator, {}, kB) == nullptr && logged("missing field eps"),
         "no eps field: refused, 'missing field eps'");
  expect(create(creator, {PluginField("eps", &eps64, PluginFieldType::kFLOAT64, 1)}, kB) == nullptr &&
             logged("must be one kFLOAT32"),
         "eps as kFLOAT64: refused, names the type wanted");
  expect(create(creator, {PluginField("eps", two, PluginFieldType::kFLOAT32, 2)}, kB) == nullptr && logged("length 2"),
         "eps with two values: refused");
  expect(create(creator, {PluginField("eps", &zero, PluginFieldType::kFLOAT32, 1)}, kB) == nullptr &&
             logged("finite and > 0"),
         "eps 0: refused");
  expect(create(creator, {PluginField("eps", &nan, PluginFieldType::kFLOAT32, 1)}, kB) == nullptr &&
             logged("finite and > 0"),
         "eps NaN: refused");
  expect(create(creator, {eps_field, PluginField("theta", &eps, PluginFieldType::kFLOAT32, 1)}, kB) == nullptr &&
             logged("unknown field 'theta'"),
         "an unknown field: refused, named");
  // alias_cache: optional, one kINT32, 0 or 1.
  int32_t const alias_zero = 0, alias_one = 1, alias_two = 2, alias_pair[2] = {1, 1};
  float const alias_float = 1.0f;
  expect(create(creator, {eps_field, PluginField("alias_cache", &alias_two, PluginFieldType::kINT32, 1)}, kB) ==
                 nullptr &&
             logged("alias_cache must be 0 or 1, got 2"),
         "alias_cache 2: refused, named");
  expect(create(creator, {eps_field, PluginField("alias_cache", &alias_float, PluginFieldType::kFLOAT32, 1)}, kB) ==
                 nullptr &&
             logged("field alias_cache must be one kINT32"),
         "alias_cache as kFLOAT32: refused, names the type wanted");
  expect(create(creator, {eps_field, PluginField("alias_cache", alias_pair, PluginFieldType::kINT32, 2)}, kB) ==
                 nullptr &&
             logged("field alias_cache must be one kINT32"),
         "alias_cache with two values: refused, named");
  expect(create(creator, {PluginField("alias_cache", &alias_one, PluginFieldType::kINT32, 1)}, kB) == nullptr &&
             logged("missing field eps"),
         "alias_cache without eps: refused, 'missing field eps'");

  IPluginV3* plugin = create(creator, {eps_field}, kB);
  expect(plugin != nullptr, "createPlugin(eps = 1e-5, build phase)");
  auto* core = static_cast<IPluginV3OneCore*>(plugin->getCapabilityInterface(PluginCapabilityType::kCORE));
  IPluginCapability* build_cap = plugin->getCapabilityInterface(PluginCapabilityType::kBUILD);
  auto* rt = static_cast<IPluginV3OneRuntime*>(plugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
  expect(core != nullptr && build_cap != nullptr && rt != nullptr, "core, build and runtime capabilities");
  expect(std::strcmp(core->getPluginName(), "DFlashKVInject") == 0 &&
             std::strcmp(core->getPluginVersion(), "1") == 0 &&
             std::strcmp(core->getPluginNamespace(), "dflash_trt") == 0,
         "plugin name / version / namespace");
  InterfaceInfo const binfo = build_cap->getInterfaceInfo();
  expect(std::strcmp(binfo.kind, "PLUGIN_V3ONE_BUILD") == 0 && binfo.major == 2,
         "the build capability is IPluginV3OneBuildV2 (aliasing)", binfo.kind);
  auto* build = static_cast<IPluginV3OneBuildV2*>(build_cap);
  expect(std::strcmp(rt->getInterfaceInfo().kind, "PLUGIN_V3ONE_RUNTIME") == 0, "the runtime capability's kind");
  expect(build->getNbOutputs() == 1, "getNbOutputs() == 1");
  expect(build->getAliasedInput(0) == -1 && build->getAliasedInput(1) == -1 && alias_of(plugin) == 0,
         "no alias_cache: alias_cache 0, output 0 not aliased (getAliasedInput -1)");
  IPluginV3* aliasing =
      create(creator, {eps_field, PluginField("alias_cache", &alias_one, PluginFieldType::kINT32, 1)}, kB);
  expect(aliasing != nullptr && aliased_input(aliasing) == 4 && alias_of(aliasing) == 1 && eps_of(aliasing) == eps,
         "alias_cache 1: output 0 aliases input 4 (the cache)");
  {
    auto* ab = static_cast<IPluginV3OneBuildV2*>(aliasing->getCapabilityInterface(PluginCapabilityType::kBUILD));
    expect(ab->getAliasedInput(1) == -1, "alias_cache 1: only output 0 is aliased");
  }
  IPluginV3* not_aliasing =
      create(creator, {PluginField("alias_cache", &alias_zero, PluginFieldType::kINT32, 1), eps_field}, kB);
  expect(not_aliasing != nullptr && aliased_input(not_aliasing) == -1 && alias_of(not_aliasing) == 0,
         "alias_cache 0 (before eps): output 0 not aliased");
  delete not_aliasing;

  // Output dtype = the cache's dtype.
  for (DataType t : {DataType::kFLOAT, DataType::kHALF, DataType::kBF16}) {
    DataType in[7] = {t, t, DataType::kFLOAT, DataType::kFLOAT, t, DataType::kINT64, DataType::kINT64};
    DataType out = DataType::kINT8;
    expect(build->getOutputDataTypes(&out, 1, in, 7) == 0 && out == t,
           (std::string("getOutputDataTypes: output type = cache type, ") + type_name(t)).c_str());
  }
  DataType in7[7] = {};
  DataType out1 = DataType::kFLOAT;
  expect(build->getOutputDataTypes(&out1, 1, in7, 6) != 0 && logged("takes 7 inputs"),
         "getOutputDataTypes with 6 inputs: error, names the 7 inputs");

  // Format combinations.
  Shape s;
  for (DataType t : {DataType::kFLOAT, DataType::kHALF, DataType::kBF16})
    expect(accepts_all(build, dynamic(descs(s.inputs(), t))),
           (std::string("supportsFormatCombination accepts ") + type_name(t)).c_str());
  struct Bad {
    int pos;
    DataType type;
    char const* what;
  } const bad[] = {
      {0, DataType::kINT8, "rejects int8 kv"},
      {0, DataType::kINT32, "rejects int32 kv"},
      {1, DataType::kHALF, "rejects k_norm not in kv's dtype"},
      {2, DataType::kHALF, "rejects float16 cos"},
      {3, DataType::kBF16, "rejects bfloat16 sin"},
      {4, DataType::kHALF, "rejects a float32 kv with a float16 cache"},
      {5, DataType::kINT32, "rejects int32 rows"},
      {6, DataType::kINT32, "rejects int32 positions"},
      {7, DataType::kBF16, "rejects an output not in the cache's dtype"},
  };
  for (Bad const& b : bad) {
    auto d = dynamic(descs(s.inputs(), DataType::kFLOAT));
    d[b.pos].desc.type = b.type;
    expect(!build->supportsFormatCombination(b.pos, d.data(), 7, 1), b.what);
  }
  {
    auto d = dynamic(descs(s.inputs(), DataType::kHALF));
    d[4].desc.format = TensorFormat::kHWC8;
    expect(!build->supportsFormatCombination(4, d.data(), 7, 1), "rejects a non-linear format");
  }

  // getOutputShapes copies input 4's expressions; it never calls the builder, so neither the expressions (distinct
  // dummy addresses) nor the builder (a dummy reference) are dereferenced.
  {
    alignas(16) static char dummy[7][8][16];
    DimsExprs ins[7];
    int32_t const ranks[7] = {3, 2, 3, 3, 6, 1, 2};
    for (int i = 0; i < 7; ++i) {
      ins[i].nbDims = ranks[i];
      for (int k = 0; k < ranks[i]; ++k) ins[i].d[k] = reinterpret_cast<IDimensionExpr const*>(&dummy[i][k]);
    }
    alignas(16) static char builder_storage[64];
    IExprBuilder& builder = *reinterpret_cast<IExprBuilder*>(builder_storage);
    DimsExprs out{};
    expect(build->getOutputShapes(ins, 7, nullptr, 0, &out, 1, builder) == 0 && out.nbDims == 6,
           "getOutputShapes: rank 6");
    bool same = true;
    for (int k = 0; k < 6; ++k) same = same && out.d[k] == ins[4].d[k];
    expect(same, "getOutputShapes: output 0's dimensions are input 4's expressions");
    ins[4].nbDims = 5;
    expect(build->getOutputShapes(ins, 7, nullptr, 0, &out, 1, builder) != 0 && logged("cache must be"),
           "getOutputShapes with a rank-5 cache: error");
  }

  // configurePlugin: build-time shapes, with wildcards (-1) for the token dimensions n and c.
  {
    auto d = dynamic(descs(s.inputs(), DataType::kHALF));
    for (int i : {0, 2, 3, 6}) d[i].desc.dims.d[0] = d[i].desc.dims.d[1] = -1;
    d[5].desc.dims.d[0] = -1;
    expect(build->configurePlugin(d.data(), 7, d.data() + 7, 1) == 0 && take_log().empty(),
           "configurePlugin accepts wildcard n, c");
    auto e = d;
    e[0].desc.dims.d[2] += 1;
    expect(build->configurePlugin(e.data(), 7, e.data() + 7, 1) != 0 &&
               logged("kv's last dimension must be L * 2 * H * D = 64"),
           "configurePlugin: kv's last dimension != L * 2 * H * D, named");
    e = d;
    e[1].desc.dims = dims({s.L + 1, s.D});
    expect(build->configurePlugin(e.data(), 7, e.data() + 7, 1) != 0 && logged("k_norm must be [L, D]"),
           "configurePlugin: k_norm not [L, D], named");
    Shape odd;
    odd.D = 7;
    auto o = dynamic(descs(odd.inputs(), DataType::kHALF));
    expect(build->configurePlugin(o.data(), 7, o.data() + 7, 1) != 0 && logged("must be even"),
           "configurePlugin: odd head_dim, named");
  }

  // onShapeChange: every dimension known and consistent.
  {
    auto d = descs(s.inputs(), DataType::kBF16);
    expect(rt->onShapeChange(d.data(), 7, d.data() + 7, 1) == 0, "onShapeChange accepts consistent shapes");
    auto e = d;
    e[5].dims = dims({s.n + 1});
    expect(rt->onShapeChange(e.data(), 7, e.data() + 7, 1) != 0 && logged("rows must be [n]"),
           "onShapeChange: rows not [n], named");
    e = d;
    e[2].dims = dims({s.n, s.c, s.D + 2});
    expect(rt->onShapeChange(e.data(), 7, e.data() + 7, 1) != 0 && logged("cos must be [n, c, D]"),
           "onShapeChange: cos not [n, c, D], named");
    e = d;
    e[7].dims = dims({2, s.L, s.B, s.H, s.cap + 1, s.D});
    expect(rt->onShapeChange(e.data(), 7, e.data() + 7, 1) != 0 && logged("output must be the cache's shape"),
           "onShapeChange: an output not of the cache's shape, named");
    Shape big;
    big.D = 4096;
    auto b = descs(big.inputs(), DataType::kBF16);
    expect(rt->onShapeChange(b.data(), 7, b.data() + 7, 1) != 0 && logged("head_dim <= 2048"),
           "onShapeChange: head_dim over the kernel's limit, named");
    // Zero-sized dimensions: L, H, D always refused; B and cap only when there are tokens.
    struct Zero {
      int64_t Shape::*dim;
      int64_t c;
      char const* needle;
      char const* what;
    } const zeros[] = {
        {&Shape::L, 3, "number of layers L must be > 0", "onShapeChange: L = 0, named"},
        {&Shape::H, 3, "number of KV heads H must be > 0", "onShapeChange: H = 0, named"},
        {&Shape::D, 3, "head_dim D must be > 0", "onShapeChange: D = 0, named"},
        {&Shape::L, 0, "number of layers L must be > 0", "onShapeChange: L = 0 without tokens, named"},
        {&Shape::B, 3, "rows B must be > 0 when there are tokens", "onShapeChange: B = 0 with tokens, named"},
        {&Shape::cap, 3, "capacity cap must be > 0 when there are tokens",
         "onShapeChange: cap = 0 with tokens, named"},
    };
    for (Zero const& z : zeros) {
      Shape zs;
      zs.*z.dim = 0;
      zs.c = z.c;
      auto zd = descs(zs.inputs(), DataType::kBF16);
      expect(rt->onShapeChange(zd.data(), 7, zd.data() + 7, 1) != 0 && logged(z.needle), z.what);
    }
    for (int64_t Shape::*dim : {&Shape::B, &Shape::cap}) {
      Shape zs;
      zs.*dim = 0;
      zs.c = 0;
      auto zd = descs(zs.inputs(), DataType::kBF16);
      expect(rt->onShapeChange(zd.data(), 7, zd.data() + 7, 1) == 0 && take_log().empty(),
             dim == &Shape::B ? "onShapeChange: B = 0 without tokens accepted"
                              : "onShapeChange: cap = 0 without tokens accepted");
    }
  }

  // Serialisation round trip (runtime phase) and clone keep eps bit for bit, and alias_cache.
  {
    PluginFieldCollection const* fc = rt->getFieldsToSerialize();
    expect(fc != nullptr && fc->nbFields == 2 && std::strcmp(fc->fields[0].name, "eps") == 0 &&
               fc->fields[0].type == PluginFieldType::kFLOAT32 && fc->fields[0].length == 1 &&
               std::strcmp(fc->fields[1].name, "alias_cache") == 0 &&
               fc->fields[1].type == PluginFieldType::kINT32 && fc->fields[1].length == 1,
           "getFieldsToSerialize: eps (kFLOAT32) and alias_cache (kINT32), one value each");
    IPluginV3* restored = creator->createPlugin("kv", fc, TensorRTPhase::kRUNTIME);
    expect(restored != nullptr && eps_of(restored) == eps && alias_of(restored) == 0 && aliased_input(restored) == -1,
           "createPlugin(runtime phase) from the serialised fields keeps eps");
    IPluginV3* copy = plugin->clone();
    expect(copy != nullptr && copy != plugin && eps_of(copy) == eps && alias_of(copy) == 0, "clone keeps eps");
    auto* art = static_cast<IPluginV3OneRuntime*>(aliasing->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    IPluginV3* restored_alias = creator->createPlugin("kv", art->getFieldsToSerialize(), TensorRTPhase::kRUNTIME);
    expect(restored_alias != nullptr && eps_of(restored_alias) == eps && alias_of(restored_alias) == 1 &&
               aliased_input(restored_alias) == 4,
           "createPlugin(runtime phase) from the serialised fields keeps alias_cache 1");
    IPluginV3* copy_alias = aliasing->clone();
    expect(copy_alias != nullptr && copy_alias != aliasing && eps_of(copy_alias) == eps &&
               alias_of(copy_alias) == 1 && aliased_input(copy_alias) == 4,
           "clone keeps alias_cache 1");
    delete restored;
    delete copy;
    delete restored_alias;
    delete copy_alias;
  }

  // attachToContext: a clone that reports to the context's error recorder (not the logger).
  {
    Recorder recorder;
    ResourceContext context(&recorder);
    IPluginV3* attached = rt->attachToContext(&context);
    expect(attached != nullptr && attached != plugin && eps_of(attached) == eps,
           "attachToContext returns a clone with eps");
    auto* art = static_cast<IPluginV3OneRuntime*>(attached->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    auto d = descs(s.inputs(), DataType::kFLOAT);
    d[6].dims = dims({s.n, s.c + 1});
    expect(art->onShapeChange(d.data(), 7, d.data() + 7, 1) != 0 && recorder.count == 1 &&
               recorder.last.find("DFlashKVInject: ") == 0 && take_log().empty(),
           "after attachToContext, problems go to the context's error recorder", recorder.last);
    expect(recorder.lastCode == ErrorCode::kINVALID_ARGUMENT, "a shape problem is reported as kINVALID_ARGUMENT");
    // A clone of the attached plugin does not carry the recorder it does not own: it reports to the logger.
    IPluginV3* clone_of_attached = attached->clone();
    auto* crt =
        static_cast<IPluginV3OneRuntime*>(clone_of_attached->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    expect(crt->onShapeChange(d.data(), 7, d.data() + 7, 1) != 0 && recorder.count == 1 &&
               logged("positions") && eps_of(clone_of_attached) == eps,
           "a clone of an attached plugin reports to the logger, not the recorder", recorder.last);
    delete clone_of_attached;
    // Without a GPU (no CUDA device here), a valid enqueue's CUDA failure is reported as kFAILED_EXECUTION: the copy
    // of the cache into a separate output, and the launch in place.
    int device_count = 0;
    if (!gpu && (cudaGetDeviceCount(&device_count) != cudaSuccess || device_count == 0)) {
      auto v = descs(s.inputs(), DataType::kFLOAT);
      static char in_stub[7][16], out_stub[16];
      void* vin[7];
      for (int i = 0; i < 7; ++i) vin[i] = in_stub[i];
      void* separate[1] = {out_stub};
      recorder.clear();
      expect(art->enqueue(v.data(), v.data() + 7, vin, separate, nullptr, nullptr) != 0 && recorder.count == 1 &&
                 recorder.lastCode == ErrorCode::kFAILED_EXECUTION &&
                 recorder.last.find("copying the cache to the output failed") != std::string::npos,
             "no GPU: the failed cache copy is reported as kFAILED_EXECUTION", recorder.last);
      void* in_place[1] = {in_stub[4]};
      recorder.clear();
      expect(art->enqueue(v.data(), v.data() + 7, vin, in_place, nullptr, nullptr) != 0 && recorder.count == 1 &&
                 recorder.lastCode == ErrorCode::kFAILED_EXECUTION &&
                 recorder.last.find("dflash_kv_inject_guarded failed") != std::string::npos,
             "no GPU: the failed launch is reported as kFAILED_EXECUTION", recorder.last);
    }
    delete attached;
  }

  // enqueue's paths that end before the GPU: a bad shape launches nothing; zero tokens in place launch nothing.
  {
    auto d = descs(s.inputs(), DataType::kFLOAT);
    d[1].dims = dims({s.L, s.D + 1});
    void* fake[7] = {};
    void* out[1] = {nullptr};
    expect(rt->enqueue(d.data(), d.data() + 7, fake, out, nullptr, nullptr) != 0 && logged("k_norm must be [L, D]"),
           "enqueue with a bad shape: nonzero, nothing launched, named");
    Shape headless;
    headless.H = 0;
    auto hd = descs(headless.inputs(), DataType::kFLOAT);
    expect(rt->enqueue(hd.data(), hd.data() + 7, fake, out, nullptr, nullptr) != 0 &&
               logged("number of KV heads H must be > 0"),
           "enqueue with H = 0: nonzero, nothing launched, named");
    Shape empty;
    empty.c = 0;
    auto z = descs(empty.inputs(), DataType::kFLOAT);
    static char cache_stub[16];
    void* zin[7] = {nullptr, nullptr, nullptr, nullptr, cache_stub, nullptr, nullptr};
    void* zout[1] = {cache_stub};
    expect(rt->enqueue(z.data(), z.data() + 7, zin, zout, nullptr, nullptr) == 0,
           "enqueue of zero tokens in place: 0, nothing launched");
  }

  if (gpu) gpu_checks(plugin, eps);
  delete aliasing;
  delete plugin;
  std::printf("ALL OK %d checks\n", gChecks);
  return 0;
}
