// libFuzzer harness: the session import path a peer worker drives with
// ImportSession. The input is a sequence of length-prefixed (2 bytes, little
// endian) serialized kvcache.v1.SessionChunk messages; each is decoded by
// service::FromWire and fed to a kv::SessionImporter on a small KvCacheManager
// (1 layer, 1 KV head, head_dim 8, f16, 4-token pages of 128 bytes; 16 pages of
// tier 0, 8 of tier 1) that already holds one session, as the worker's
// ImportReactor does: the first error ends the stream. After every input the
// manager's invariants hold, and an import that did not commit left no staged
// page and no session behind.
//
// Seeds: KVCACHE_FUZZ_WRITE_SEEDS=DIR ./chunk_decoder_fuzz writes valid exports
// (of a session made on an identical manager) into DIR and exits
// (tests/fuzz/corpus/chunk/).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "kvcache/v1/worker.pb.h"
#include "worker/kv/kv_cache_manager.h"
#include "worker/kv/kv_transfer.h"
#include "worker/service/chunk_convert.h"

namespace {

namespace kv = kvcache::kv;

void Check(bool ok, const char* what, const absl::Status& detail = absl::OkStatus()) {
  if (!ok) {
    std::fprintf(stderr, "violated: %s %s\n", what, detail.ToString().c_str());
    std::abort();
  }
}

std::unique_ptr<kv::KvCacheManager> MakeManager() {
  kv::KvCacheOptions o;
  o.shape.layers = 1;
  o.shape.kv_heads = 1;
  o.shape.head_dim = 8;
  o.shape.dtype = kv::KvDtype::kF16;
  o.shape.page_tokens = 4;
  o.model_id = "fuzz-model";
  o.tier0_bytes = 16 * o.shape.page_bytes();
  o.tier1_bytes = 8 * o.shape.page_bytes();
  o.max_session_tokens = 256;
  auto m = kv::KvCacheManager::Create(o);
  Check(m.ok(), "KvCacheManager::Create", m.status());
  // A resident session, so that imports can collide with it and pressure can
  // move it.
  Check((*m)->CreateSession("resident", "tenant-a").ok(), "CreateSession");
  std::vector<int32_t> tokens;
  for (int i = 0; i < 10; ++i) tokens.push_back(100 + i);
  Check((*m)->AppendTokens("resident", tokens).ok(), "AppendTokens");
  return std::move(*m);
}

std::string Frame(const std::vector<kvcache::v1::SessionChunk>& chunks) {
  std::string out;
  for (const auto& c : chunks) {
    const std::string bytes = c.SerializeAsString();
    out.push_back(static_cast<char>(bytes.size() & 0xff));
    out.push_back(static_cast<char>(bytes.size() >> 8));
    out += bytes;
  }
  return out;
}

void WriteSeeds(const std::string& dir) {
  auto src = MakeManager();
  int n = 0;
  for (int tokens : {3, 9, 22}) {
    const std::string id = "moving-" + std::to_string(tokens);
    Check(src->CreateSession(id, "tenant-a").ok(), "CreateSession");
    std::vector<int32_t> ids;
    for (int i = 0; i < tokens; ++i) ids.push_back(200 + i * 3);
    Check(src->AppendTokens(id, ids).ok(), "AppendTokens");
    {
      kv::ExportOptions eo;
      eo.max_chunk_bytes = 1 << 10;  // the smallest: several page chunks
      auto chunks = kv::ExportSession(src.get(), id, eo);
      Check(chunks.ok(), "ExportSession", chunks.status());
      std::vector<kvcache::v1::SessionChunk> wire;
      ids.push_back(7);  // the last sampled token, without K/V yet
      for (size_t i = 0; i < chunks->size(); ++i) {
        wire.push_back(kvcache::service::ToWire((*chunks)[i], static_cast<int32_t>(i), ids));
      }
      ids.pop_back();
      std::ofstream(dir + "/export-" + std::to_string(n++), std::ios::binary) << Frame(wire);
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  if (const char* dir = std::getenv("KVCACHE_FUZZ_WRITE_SEEDS")) {
    WriteSeeds(dir);
    std::exit(0);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto manager = MakeManager();
  const int64_t sessions_before = manager->GetStats().sessions;
  auto importer = kv::SessionImporter::Create(manager.get());
  Check(importer.ok(), "SessionImporter::Create", importer.status());
  bool failed = false;
  size_t pos = 0;
  while (pos + 2 <= size && !failed) {
    const size_t len = data[pos] | (static_cast<size_t>(data[pos + 1]) << 8);
    pos += 2;
    if (len > size - pos) break;
    kvcache::v1::SessionChunk wire;
    const bool parsed = wire.ParseFromArray(data + pos, static_cast<int>(len));
    pos += len;
    if (!parsed) {
      failed = true;  // gRPC would end the stream
      break;
    }
    if ((*importer)->committed()) {
      failed = true;  // the worker refuses chunks after the commit
      break;
    }
    std::vector<int32_t> context;
    auto chunk = kvcache::service::FromWire(wire, &context);
    if (!chunk.ok()) {
      Check(chunk.status().code() == absl::StatusCode::kInvalidArgument, "FromWire error code",
            chunk.status());
      failed = true;
      break;
    }
    const absl::Status st = (*importer)->Add(*chunk);
    if (!st.ok()) {
      failed = true;
      // "Any error frees the staging pages": nothing staged from here on.
      const kv::KvStats after = manager->GetStats();
      Check(after.tier[0].in_flight_pages == 0 && after.tier[1].in_flight_pages == 0,
            "staged pages left after a failed Add", st);
    }
    Check(manager->CheckInvariants().ok(), "invariants after Add", manager->CheckInvariants());
  }
  const bool committed = (*importer)->committed();
  const std::string id = (*importer)->session_id();
  importer->reset();  // frees staging unless committed
  const kv::KvStats stats = manager->GetStats();
  Check(manager->CheckInvariants().ok(), "invariants after the import", manager->CheckInvariants());
  Check(stats.tier[0].in_flight_pages == 0 && stats.tier[1].in_flight_pages == 0,
        "staged pages left after the import");
  if (committed) {
    Check(manager->GetTokens(id).ok(), "a committed session is not there");
  } else {
    // Nothing new became visible (pressure may have dropped the resident one).
    Check(stats.sessions <= sessions_before, "an uncommitted import left a session");
  }
  return 0;
}
