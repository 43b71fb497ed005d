#pragma once
// The layers x query-heads grid of a model: one row per layer, one column per query head. Each cell
// shows the KV group its head reads under GQA (head h reads KV head h / (Hq/Hkv), DESIGN §4) and is
// tinted by that group, alternating two hues so neighbouring groups stay distinguishable. Later
// views reuse the same grid for per-head scores and the FA-head selection.
#include <QAbstractTableModel>
#include <QColor>

namespace hh::workbench {

class HeadGridModel : public QAbstractTableModel {
  Q_OBJECT

 public:
  enum Role {
    KvGroupRole = Qt::UserRole + 1,  // int: KV group of the cell's query head
    LayerRole,                       // int: layer index
    HeadRole,                        // int: query head index
  };

  explicit HeadGridModel(QObject* parent = nullptr);

  // Replaces the grid. `query_heads` must be a positive multiple of `kv_heads`; otherwise (or for
  // zero layers) the grid becomes empty.
  void setShape(int layers, int query_heads, int kv_heads);
  void clear() { setShape(0, 0, 0); }

  int layers() const { return layers_; }
  int queryHeads() const { return query_heads_; }
  int kvHeads() const { return kv_heads_; }
  int groupSize() const { return kv_heads_ > 0 ? query_heads_ / kv_heads_ : 0; }
  int kvGroup(int head) const { return groupSize() > 0 ? head / groupSize() : -1; }
  // Background and text colours of a group's cells, for the current application palette.
  QColor groupTint(int group) const;
  QColor groupTextColor(int group) const;

  int rowCount(const QModelIndex& parent = {}) const override;
  int columnCount(const QModelIndex& parent = {}) const override;
  QVariant data(const QModelIndex& index, int role = Qt::DisplayRole) const override;
  QVariant headerData(int section, Qt::Orientation orientation, int role = Qt::DisplayRole) const override;

 private:
  int layers_ = 0;
  int query_heads_ = 0;
  int kv_heads_ = 0;
};

}  // namespace hh::workbench
